"""The fused log-prob op with the loss's gradient taken in its forward (polyrl.core.algorithms.linear_loss): the core
reference and the cuda backend's cuBLAS version (``cublas_linear_logprob_loss``), on CPU tensors, against the
unfused path (``linear_logprobs_and_entropy``, then the same loss through autograd). The loss is PPO-like
(``ppo_like``: its gradient depends on the log-prob) plus an entropy term, so a fused op that took the gradient at
other values than its own log-probs would fail. The cuBLAS version runs with its two Triton epilogues under
TRITON_INTERPRET=1 ("triton") and with their torch stand-ins ("torch"); both kept in one file because they share
the cases (the core reference imports no Triton)."""

from __future__ import annotations

import pytest
import torch
from linear_logprobs_cases import fused_loss_grads, loss_inputs, make_inputs, unfused_loss_grads

import polyrl.backends.cuda.linear_logprobs as LL
import polyrl.core.algorithms.linear_loss as LOSS
from polyrl.core.algorithms.linear_logprobs import linear_logprobs_and_entropy
from polyrl.core.algorithms.linear_loss import linear_logprob_loss
from polyrl.core.tolerances import relative_error, tolerance

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-tensor tests (the gpu tests cover CUDA)")


def _check(got, ref, dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    for what, g, r in zip(("loss", "logp", "entropy"), got[:3], ref[:3]):
        err, bar = relative_error(g.float(), r.float()), tolerance("algorithms.linear_logprobs", name)
        assert err <= bar, f"{what}: {err:.2e} > {bar:.2e}"
    for what, g, r in zip(("dhidden", "dweight", "dbias"), got[3:], ref[3:]):
        assert g.dtype == dtype, what
        err, bar = relative_error(g.float(), r.float()), tolerance("algorithms.linear_logprobs_grad", name)
        assert err <= bar, f"{what}: {err:.2e} > {bar:.2e}"


@pytest.mark.parametrize("N,H,V,with_bias,tau,chunk,vchunk,entropy", [
    (37, 16, 120, True, 0.7, 8, 32, True),  # 5 chunks, the last of 5 rows; 4 vocabulary tiles
    (9, 16, 50, False, 1.0, 1024, None, True),  # one chunk
    (21, 32, 70, True, 1.3, 6, 48, False),  # no entropy: zeros, no entropy gradient
])
def test_reference_equals_the_unfused_path(N, H, V, with_bias, tau, chunk, vchunk, entropy) -> None:
    hidden, weight, bias, labels, _, _ = make_inputs(N, H, V, torch.float32, with_bias, seed=3)
    terms = loss_inputs(N)
    calls: list[tuple[int, int]] = []
    got = fused_loss_grads(linear_logprob_loss, hidden, weight, bias, labels, tau, terms, entropy=entropy,
                           calls=calls, chunk_size=chunk, vocab_chunk_size=vchunk)
    ref = unfused_loss_grads(linear_logprobs_and_entropy, hidden, weight, bias, labels, tau, terms,
                             entropy=entropy, chunk_size=chunk, vocab_chunk_size=vchunk)
    _check(got, ref, torch.float32)
    step = min(chunk, N)
    assert calls == [(t0, min(t0 + step, N)) for t0 in range(0, N, step)]  # once per chunk, in row order
    if not entropy:
        assert torch.all(got[2] == 0)


@cpu_only
@pytest.mark.parametrize("epilogue", ["triton", "torch"], indirect=True)
@pytest.mark.parametrize("N,H,V,dtype,with_bias,tau,chunk,entropy", [
    (37, 16, 120, torch.float32, True, 0.7, 8, True),  # 5 token chunks, the last ragged
    (9, 16, 50, torch.float32, False, 1.0, 1024, False),  # one chunk, V not a multiple of 16, no entropy
    (21, 32, 70, torch.float16, True, 1.3, 6, True),  # fp16 matmuls, fp32 logits, dW summed in fp32
])
def test_cublas_fused_loss_equals_the_unfused_path(epilogue, N, H, V, dtype, with_bias, tau, chunk, entropy) -> None:
    hidden, weight, bias, labels, _, _ = make_inputs(N, H, V, dtype, with_bias, seed=4, label_in_last_tile=True)
    terms = loss_inputs(N)
    calls: list[tuple[int, int]] = []
    got = fused_loss_grads(LL.cublas_linear_logprob_loss, hidden, weight, bias, labels, tau, terms, entropy=entropy,
                           calls=calls, chunk_size=chunk)
    ref = unfused_loss_grads(linear_logprobs_and_entropy, hidden, weight, bias, labels, tau, terms,
                             entropy=entropy, chunk_size=chunk)
    _check(got, ref, dtype)
    assert calls[0][0] == 0 and calls[-1][1] == N and len(calls) == -(-N // min(chunk, N))


@cpu_only
@pytest.mark.parametrize("epilogue", ["torch"], indirect=True)
def test_dw_summed_in_the_weight_dtype_past_its_budget(epilogue, monkeypatch) -> None:
    """A dW too large for an fp32 sum (GPT-OSS width) is summed in the weight's dtype, one rounding per token chunk:
    still within the fp16 gradient bar at 4 chunks."""
    monkeypatch.setattr(LOSS, "DW_FP32_BYTES", 0)
    hidden, weight, bias, labels, _, _ = make_inputs(29, 16, 60, torch.float16, True, seed=6)
    assert LOSS.dw_accumulator_dtype(weight) == torch.float16
    terms = loss_inputs(29)
    got = fused_loss_grads(LL.cublas_linear_logprob_loss, hidden, weight, bias, labels, 0.9, terms, chunk_size=8)
    ref = unfused_loss_grads(linear_logprobs_and_entropy, hidden, weight, bias, labels, 0.9, terms, chunk_size=8)
    _check(got, ref, torch.float16)


def test_chunk_rows_and_dw_dtype_at_gpt_oss_width() -> None:
    V, H = 201088, 2880
    assert LOSS.fused_token_chunk(16384, V, 2, 1024) == 640  # fp32 z + bf16 ∂z of 640 rows: 736 MiB
    assert LOSS.fused_token_chunk(16384, V, 4, 1024) == 896  # fp32: ∂z overwrites z
    assert LOSS.fused_token_chunk(16384, V, 2, 512) == 512  # the caller's chunk_size bounds it
    assert LOSS.fused_token_chunk(100, 8192, 2, 1024) == 100
    big = torch.empty(V, H, dtype=torch.bfloat16, device="meta")
    assert LOSS.dw_accumulator_dtype(big) == torch.bfloat16  # fp32 would be 2.2 GiB
    assert LOSS.dw_accumulator_dtype(torch.empty(8192, 64, dtype=torch.bfloat16, device="meta")) == torch.float32


@pytest.mark.parametrize("fn", ["reference", "cublas"])
def test_bad_token_grads_are_refused(fn) -> None:
    op = linear_logprob_loss if fn == "reference" else LL.cublas_linear_logprob_loss
    if fn == "cublas" and torch.cuda.is_available():
        pytest.skip("CPU tensors")
    hidden, weight, _, labels, _, _ = make_inputs(10, 16, 40, torch.float32, False)
    h = hidden.clone().requires_grad_()
    with pytest.raises(ValueError, match="compute_entropy is false"):
        op(h, weight, labels, lambda t0, t1, lp, ent: (torch.ones_like(lp), torch.ones_like(ent)),
           compute_entropy=False)
    with pytest.raises(ValueError, match=r"g_lp must be \[4\] for rows \[0, 4\)"):
        op(h, weight, labels, lambda t0, t1, lp, ent: (torch.ones(3), None), chunk_size=4)


def test_no_gradient_wanted_and_no_term() -> None:
    """Inputs without requires_grad: values only (the anchor is a constant zero); a token_grad with neither term:
    zero gradients."""
    hidden, weight, _, labels, _, _ = make_inputs(12, 16, 40, torch.float32, False)
    anchor, lp, ent = linear_logprob_loss(hidden, weight, labels, lambda t0, t1, a, b: (None, None))
    assert not anchor.requires_grad and lp.shape == (12,) and ent.shape == (12,)
    ref_lp, ref_ent = linear_logprobs_and_entropy(hidden, weight, labels)
    for got, want in ((lp, ref_lp), (ent, ref_ent)):
        assert relative_error(got, want) <= tolerance("algorithms.linear_logprobs", "float32")
    h = hidden.clone().requires_grad_()
    anchor, _, _ = linear_logprob_loss(h, weight, labels, lambda t0, t1, a, b: (None, None), chunk_size=5)
    anchor.backward()
    assert torch.all(h.grad == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,H,V,with_bias,dw_budget", [(1000, 256, 5001, False, None), (333, 128, 3000, True, 0)])
def test_gpu_cublas_fused_loss_equals_the_unfused_path(N, H, V, with_bias, dw_budget, dtype, monkeypatch) -> None:
    """On the GPU, bf16 / fp32 (the Triton epilogues compiled, cuBLAS fp32-output GEMMs): values and gradients
    against the unfused cuBLAS path with the same loss; ``dw_budget`` 0 sums dW in the weight's dtype."""
    if dw_budget is not None:
        monkeypatch.setattr(LOSS, "DW_FP32_BYTES", dw_budget)
    hidden, weight, bias, labels, _, _ = make_inputs(N, H, V, dtype, with_bias, seed=7, label_in_last_tile=True)
    terms = loss_inputs(N)
    got = fused_loss_grads(LL.cublas_linear_logprob_loss, hidden, weight, bias, labels, 0.8, terms, device="cuda",
                           chunk_size=128)
    ref = unfused_loss_grads(LL.cublas_linear_logprobs, hidden, weight, bias, labels, 0.8, terms, device="cuda",
                             chunk_size=128)
    _check(got, ref, dtype)


@cpu_only
def test_model_step_fused_loss_row_gives_the_fused_rows_gradients() -> None:
    """bench/model_step.py's "polyrl+fusedloss" (DAPO's loss with its gradient taken inside the op) against its
    "polyrl+fused" (the trainer's path: log-probs, then the loss through autograd), on a tiny GPT-OSS in fp32: the
    same loss value and parameter gradients."""
    from bench_scripts import load_bench

    from polyrl.core.models import build_model

    bench = load_bench("model_step")
    model = build_model("gpt_oss_tiny", vocab_size=40, seed=0)
    ids = torch.randint(0, 40, (1, 23), generator=torch.Generator().manual_seed(0))
    results = []
    for fn in (bench.fused_policy_loss, bench.fused_loss_policy_loss):
        model.zero_grad(set_to_none=True)
        loss = fn(model, ids)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert relative_error(loss_b, loss_a) <= tolerance("algorithms.linear_logprobs", "float32")
    assert grads_a.keys() == grads_b.keys() and "lm_head.weight" in grads_a
    for name in grads_a:
        err = relative_error(grads_b[name], grads_a[name])
        assert err <= tolerance("algorithms.linear_logprobs_grad", "float32"), f"{name}: {err:.2e}"


def test_the_gradients_are_handed_out_once_and_scaled_by_the_anchors() -> None:
    """The anchor's gradient scales the kept gradients (here 3 x); a second backward through the same graph
    (retain_graph) is refused, not answered with gradients already scaled."""
    hidden, weight, _, labels, _, _ = make_inputs(12, 16, 40, torch.float32, False)
    grads = []
    for scale in (1.0, 3.0):
        h = hidden.clone().requires_grad_()
        anchor, _, _ = linear_logprob_loss(h, weight, labels, lambda t0, t1, lp, ent: (torch.ones_like(lp), None),
                                           chunk_size=5)
        (scale * anchor).backward(retain_graph=True)
        grads.append(h.grad.clone())
        with pytest.raises(RuntimeError, match="handed out by an earlier backward"):
            anchor.backward()
    assert torch.allclose(grads[1], 3 * grads[0]) and grads[0].abs().sum() > 0
