"""The cuBLAS path of the cuda backend's fused lm_head + log-prob + entropy (``cublas_linear_logprobs``,
POLYRL_LINEAR_LOGPROBS=cublas) on CPU tensors: values against fp64 through the full logits, gradients against the
core reference, in fp32 (the math exactly) and fp16 (the low-precision path; bf16 is the gpu tests' job: the
interpreter gets bf16 arithmetic wrong). Each case runs twice: with the two Triton epilogues under TRITON_INTERPRET=1
("triton") and with their torch stand-ins ("torch", what CPU tensors get without the interpreter), so both the
kernels and the chunking + matmul host code are checked. Shapes are tiny but cover several token chunks with a
ragged last one, vocabulary chunks with a ragged last one, V not a multiple of the 16-column blocks, several
vocabulary slices (the slice merge), bias, temperature, labels at both vocabulary ends, compute_entropy off, and
either output unused (its gradient None). Also: the POLYRL_LINEAR_LOGPROBS switch and the GPT-OSS-width chunk sizes.
"""

from __future__ import annotations

import pytest
import torch
from linear_logprobs_cases import cublas_kernel, fp64_full_logits, make_inputs, run_with_grads, triton_kernel

import polyrl.backends.cuda.linear_logprobs as LL
from polyrl.backends.cuda.linear_logprobs_choice import PATH_ENV, linear_logprobs_report
from polyrl.core.algorithms.linear_logprobs import linear_logprobs_and_entropy
from polyrl.core.errors import BadInputError
from polyrl.core.tolerances import relative_error, tolerance

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-tensor tests (the gpu tests cover CUDA)")
EPILOGUES = ["triton", "torch"]


def _inputs(N, H, V, dtype, with_bias, seed=0):
    hidden, weight, bias, labels, w_lp, w_ent = make_inputs(N, H, V, dtype, with_bias, seed, label_in_last_tile=True)
    labels[0] = 0  # and one at the first column of the first chunk
    return hidden, weight, bias, labels, w_lp, w_ent


@cpu_only
@pytest.mark.parametrize("epilogue", EPILOGUES, indirect=True)
@pytest.mark.parametrize("N,H,V,dtype,with_bias,tau,chunk,vchunk", [
    (37, 16, 120, torch.float32, True, 0.7, 8, 32),  # 5 token chunks (last 5 rows), 4 vocab chunks (last 24)
    (9, 16, 50, torch.float32, False, 1.0, 1024, None),  # one chunk each way, V not a multiple of 16
    (21, 32, 70, torch.float16, True, 1.3, 6, 48),  # fp16 matmuls, fp32 logits and statistics
    (12, 16, 33, torch.float16, False, 0.9, 5, 16),  # fp16, no bias, V = 2 x 16 + 1
])
def test_cublas_equals_fp64_and_reference(epilogue, N, H, V, dtype, with_bias, tau, chunk, vchunk) -> None:
    args = _inputs(N, H, V, dtype, with_bias)
    got = run_with_grads(cublas_kernel(), *args, tau, chunk_size=chunk, vocab_chunk_size=vchunk)
    ref = run_with_grads(linear_logprobs_and_entropy, *args, tau, chunk_size=chunk, vocab_chunk_size=vchunk)
    name = str(dtype).removeprefix("torch.")
    for what, g, e in zip(("logp", "entropy"), got[:2], fp64_full_logits(*args[:4], tau)):
        assert g.dtype == torch.float32
        err, bar = relative_error(g, e), tolerance("algorithms.linear_logprobs", name)
        assert err <= bar, f"{what}: {err:.2e} > {bar:.2e}"
    for what, g, r in zip(("dhidden", "dweight", "dbias"), got[2:], ref[2:]):
        assert g.dtype == dtype
        err, bar = relative_error(g.float(), r.float()), tolerance("algorithms.linear_logprobs_grad", name)
        assert err <= bar, f"{what}: {err:.2e} > {bar:.2e}"


def _record_backward(monkeypatch, name: str) -> list[tuple[bool, bool]]:
    """Patch LL.<name> (a path's backward) to record whether it got (g_lp, g_ent)."""
    calls: list[tuple[bool, bool]] = []
    real = getattr(LL, name)

    def spy(hidden, weight, bias, labels, lse, ent, g_lp, g_ent, **kw):
        calls.append((g_lp is not None, g_ent is not None))
        return real(hidden, weight, bias, labels, lse, ent, g_lp, g_ent, **kw)

    monkeypatch.setattr(LL, name, spy)
    return calls


@cpu_only
# the Triton path has no torch stand-in for its kernels: it runs with the Triton epilogue only
@pytest.mark.parametrize(("path", "epilogue"), [("cublas", "triton"), ("cublas", "torch"), ("triton", "triton")],
                         indirect=["epilogue"])
def test_no_entropy_gradient_when_not_computed(epilogue, path, monkeypatch) -> None:
    """compute_entropy=False (the trainer's update with entropy_coeff = 0): the entropies are zeros, the backward
    gets no entropy gradient even when the loss adds them, and the gradients equal the log-prob-only loss's."""
    fn = cublas_kernel() if path == "cublas" else LL.triton_fused_linear_logprobs
    calls = _record_backward(monkeypatch, "linear_backward_cublas" if path == "cublas" else "linear_backward_triton")
    hidden, weight, bias, labels, w_lp, w_ent = _inputs(19, 16, 45, torch.float32, True, seed=5)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    lp, ent = fn(leaves[0], leaves[1], labels, bias=leaves[2], compute_entropy=False, temperature=0.8,
                 chunk_size=7, vocab_chunk_size=16)
    assert torch.all(ent == 0) and not ent.requires_grad
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    assert calls == [(True, False)]
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    lp_ref, _ = linear_logprobs_and_entropy(ref_leaves[0], ref_leaves[1], labels, bias=ref_leaves[2],
                                            temperature=0.8, chunk_size=7, vocab_chunk_size=16)
    (lp_ref * w_lp).sum().backward()
    assert relative_error(lp.detach(), lp_ref.detach()) <= tolerance("algorithms.linear_logprobs", "float32")
    for a, b in zip(leaves, ref_leaves):
        assert relative_error(a.grad, b.grad) <= tolerance("algorithms.linear_logprobs_grad", "float32")


@cpu_only
@pytest.mark.parametrize("epilogue", EPILOGUES, indirect=True)
@pytest.mark.parametrize("use_lp,use_ent", [(True, False), (False, True)])
def test_cublas_single_output_in_loss(epilogue, use_lp, use_ent, monkeypatch) -> None:
    """compute_entropy=True but only one output in the loss: the other's gradient arrives as None (HAS_GLP /
    HAS_GENT off) and the gradients equal the reference's."""
    calls = _record_backward(monkeypatch, "linear_backward_cublas")
    hidden, weight, _, labels, w_lp, w_ent = _inputs(20, 16, 45, torch.float32, False, seed=3)
    grads = []
    for fn in (cublas_kernel(), linear_logprobs_and_entropy):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = fn(h, w, labels, chunk_size=6, vocab_chunk_size=16)
        ((lp * w_lp).sum() if use_lp else (ent * w_ent).sum()).backward()
        grads.append((h.grad, w.grad))
    assert calls == [(use_lp, use_ent)]
    bar = tolerance("algorithms.linear_logprobs_grad", "float32")
    assert all(relative_error(g, r) <= bar for g, r in zip(*grads))


@cpu_only
def test_cublas_float64_and_batched_shape() -> None:
    """[B, T, H] inputs give [B, T] outputs; fp64 inputs run the exact reference."""
    hidden, weight, _, labels, _, _ = _inputs(12, 8, 30, torch.float32, False)
    lp, ent = cublas_kernel()(hidden.reshape(3, 4, 8), weight, labels.reshape(3, 4), chunk_size=5)
    lp_ref, ent_ref = linear_logprobs_and_entropy(hidden, weight, labels)
    assert lp.shape == (3, 4) and ent.shape == (3, 4)
    assert relative_error(lp.reshape(-1), lp_ref) <= 1e-6 and relative_error(ent.reshape(-1), ent_ref) <= 1e-6
    lp64, _ = cublas_kernel()(hidden.double(), weight.double(), labels)
    assert lp64.dtype == torch.float64


def test_accumulate_fallback_sums_in_fp32(monkeypatch) -> None:
    """Without the fp32-accumulating GEMM (CPU, old torch) dH adds fp32 row blocks: blocks of 3 rows give the
    one-shot product."""
    monkeypatch.setattr(LL, "ACC_TEMP_BYTES", 3 * 4 * 5)  # 3 rows of an [·, 5] fp32 product per block
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(10, 7, generator=g).half(), torch.randn(7, 5, generator=g).half()
    acc = torch.randn(10, 5, generator=g)
    want = acc + (a @ b).float()  # the fallback rounds each product to fp16 when it has no fp32-output mm
    LL._mm_accumulate(acc, a, b)
    assert torch.allclose(acc, want, atol=1e-6)


def test_path_report_names_what_runs(monkeypatch) -> None:
    """``polyrl backends`` (kernel_choices): the path and how it was chosen, without importing Triton; a bad value
    is reported, not raised (the command must not fail on it)."""
    from polyrl.backends.cuda import CudaBackend

    monkeypatch.delenv(PATH_ENV, raising=False)
    report = CudaBackend().introspection.kernel_choices()["linear_logprobs"]
    assert report["bfloat16 / float16 / float32"].startswith("cublas (the default;")
    monkeypatch.setenv(PATH_ENV, "cublas")
    assert linear_logprobs_report()["bfloat16 / float16 / float32"].startswith(f"cublas ({PATH_ENV}=cublas;")
    monkeypatch.setenv(PATH_ENV, "cuBLAS")
    assert linear_logprobs_report()["all"].startswith(f"error ({PATH_ENV}='cuBLAS'")


def test_path_switch(monkeypatch) -> None:
    """POLYRL_LINEAR_LOGPROBS, read on every call: unset/empty -> cublas, cublas -> cublas, anything else refused
    in one line naming the variable and the allowed values."""
    ran = []
    monkeypatch.setattr(LL, "triton_fused_linear_logprobs", lambda *a, **k: ran.append("triton"))
    monkeypatch.setattr(LL, "cublas_linear_logprobs", lambda *a, **k: ran.append("cublas"))
    args = _inputs(4, 8, 10, torch.float32, False)
    for value, want in ((None, "cublas"), ("", "cublas"), ("cublas", "cublas"), ("triton", "triton")):
        if value is None:
            monkeypatch.delenv(PATH_ENV, raising=False)
        else:
            monkeypatch.setenv(PATH_ENV, value)
        triton_kernel()(args[0], args[1], args[3])
        assert ran[-1] == want, value
    monkeypatch.setenv(PATH_ENV, "cuBLAS")
    with pytest.raises(BadInputError) as info:
        triton_kernel()(args[0], args[1], args[3])
    msg = str(info.value)
    assert "\n" not in msg and "POLYRL_LINEAR_LOGPROBS" in msg and "cublas, triton" in msg and "'cuBLAS'" in msg


def test_gpt_oss_width_chunks() -> None:
    """At T = 16384, H 2880, V 201088, bf16: forward chunks of 640 tokens (fp32 logits ≤ 512 MiB), backward
    chunks of 2048 columns (fp32 z + bf16 ∂z ≤ 192 MiB); with dW (bf16, the gradient itself) and dH in fp32 the
    backward stays under 1.5 GiB."""
    T, H, V = 16384, 2880, 201088
    tc = LL.token_chunk(T, V, 1024)
    vc = LL.grad_vocab_chunk(T, V, 2, None)
    assert (tc, vc) == (640, 2048)
    assert tc * V * 4 <= LL.LOGITS_BYTES and T * vc * 6 <= LL.GRAD_BYTES
    backward_peak = V * H * 2 + T * H * 4 + T * vc * 6
    assert backward_peak <= 1.5 * 2**30, backward_peak / 2**30
    assert LL.token_chunk(100, V, 1024) == 100 and LL.token_chunk(5000, 1000, 1024) == 1024
    assert LL.grad_vocab_chunk(4, 50, 4, None) == 50 and LL.grad_vocab_chunk(4, 50, 2, 16) == 16
