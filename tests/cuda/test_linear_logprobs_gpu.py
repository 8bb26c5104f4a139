"""The cuda backend's fused lm_head + log-prob + entropy on a real GPU, both paths (Triton, and cuBLAS:
POLYRL_LINEAR_LOGPROBS=cublas): bf16/fp16 against fp64 through the full logits (the bars of polyrl.core.tolerances,
derived from the reference's error), the same gradients as the core reference, and the GPT-OSS-20B width (H 2880,
V 201088) forward against the reference; the cuBLAS path's fp32-output GEMMs and its memory at 16k tokens.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from linear_logprobs_cases import cublas_kernel, make_inputs, run_with_grads, triton_kernel

from polyrl.core.algorithms.linear_logprobs import linear_logprobs_and_entropy
from polyrl.core.tolerances import relative_error, tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
KERNELS = {"triton": triton_kernel, "cublas": cublas_kernel}


@pytest.mark.parametrize("path", ["triton", "cublas"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N,H,V,with_bias", [(1000, 256, 5001, False), (333, 128, 3000, True)])
def test_triton_vs_fp64_full_logits(N, H, V, with_bias, dtype, path) -> None:
    args = make_inputs(N, H, V, dtype, with_bias)
    tau = 0.7
    # chunk_size 256: the cuBLAS path's forward in 4 token chunks (the last ragged) at N = 1000
    got = run_with_grads(KERNELS[path](), *args, tau, device="cuda", chunk_size=256)
    leaves = [t.double().requires_grad_() for t in args[:2] + ((args[2],) if with_bias else ())]
    z = leaves[0] @ leaves[1].t() + (leaves[2] if with_bias else 0)
    logs = torch.log_softmax(z / tau, -1)
    lp, ent = logs.gather(1, args[3][:, None])[:, 0], -(logs.exp() * logs).sum(-1)
    ((lp * args[4].double()).sum() + (ent * args[5].double()).sum()).backward()
    name = str(dtype).removeprefix("torch.")
    for what, g, e in (("logp", got[0], lp), ("entropy", got[1], ent)):
        err, bar = relative_error(g, e.detach()), tolerance("algorithms.linear_logprobs", name)
        assert err <= bar, f"{what} {name}: {err:.2e} > {bar:.2e}"
    for g, leaf in zip(got[2:], leaves):
        assert g.dtype == dtype
        err, bar = relative_error(g.float(), leaf.grad), tolerance("algorithms.linear_logprobs_grad", name)
        assert err <= bar, f"grad {name}: {err:.2e} > {bar:.2e}"


@pytest.mark.parametrize("path", ["triton", "cublas"])
def test_gpt_oss_width_forward_matches_reference(path) -> None:
    """H 2880, V 201088, bf16: the fused statistics equal the chunked reference's within the bf16 bar."""
    hidden, weight, _, labels, _, _ = make_inputs(512, 2880, 201088, torch.bfloat16, False, seed=1)
    h, w, lab = hidden.cuda(), weight.cuda(), labels.cuda()
    with torch.no_grad():
        lp, ent = KERNELS[path]()(h, w, lab, temperature=1.0)
        lp_ref, ent_ref = linear_logprobs_and_entropy(h, w, lab, chunk_size=512)
    for g, r in ((lp, lp_ref), (ent, ent_ref)):
        assert torch.isfinite(g).all()
        err = relative_error(g.cpu(), r.cpu())
        assert err <= tolerance("algorithms.linear_logprobs", "bfloat16"), err


@pytest.mark.parametrize("path", ["triton", "cublas"])
@pytest.mark.parametrize("name", ["gpt_oss_tiny", "deepseek_v3_tiny"])
def test_trainer_fused_path_equals_logits_path_on_gpu(name, path) -> None:
    """Both model families, packed, fp32 on the GPU: the trainer's fused path through either path's kernel gives
    the logits path's log-probs, entropies and parameter gradients."""
    from polyrl.core.models import build_model
    from polyrl.core.trainer.batch import SequenceBatch, policy_forward

    model = build_model(name, vocab_size=17, seed=0).cuda()
    batch = SequenceBatch.from_rollout(
        prompts=[[1, 5, 6], [1, 7], [1, 8, 9, 10]], responses=[[3, 4, 2], [11, 12, 13, 14], [15]],
        logprobs=[[0.0] * 3, [0.0] * 4, [0.0]], group_ids=[0, 0, 1], device="cuda")
    outs = []
    for kernel in (KERNELS[path](), None):
        model.zero_grad(set_to_none=True)
        kw = {"linear_logprobs": kernel} if kernel is not None else {}
        logp, ent = policy_forward(model, batch, [0, 1, 2], packed=True, pad_id=0, temperature=0.7, chunk_size=2,
                                   compute_entropy=True, **kw)
        w = torch.linspace(-1, 1, logp.numel(), device="cuda").reshape(logp.shape)
        ((logp * w).sum() + (ent * w.flip(-1)).sum()).backward()
        outs.append((logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                   if p.grad is not None}))
    (lp_f, ent_f, g_f), (lp_u, ent_u, g_u) = outs
    assert (lp_f - lp_u).abs().max() < 1e-4 and (ent_f - ent_u).abs().max() < 1e-4
    assert g_f.keys() == g_u.keys()
    assert max(relative_error(g_f[k], g_u[k]) for k in g_f) < 1e-4


def test_cublas_path_has_fp32_output_gemms() -> None:
    """The cuBLAS path's fast kernels exist on this torch: fp32 logits straight from bf16 inputs
    (torch.mm(..., out_dtype=torch.float32)) and dH accumulated in fp32 by cuBLAS (baddbmm into an fp32 out).
    Without them it still runs, slower and with logits rounded to bf16: an H200 timing would not be the path's."""
    import polyrl.backends.cuda.linear_logprobs as LL

    assert LL._fp32_gemms(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16) == (True, True)


def test_cublas_memory_at_gpt_oss_width() -> None:
    """T = 16384, H 2880, V 201088, bf16, fwd+bwd with the entropy in the loss: extra peak memory (dH and dW
    counted, as bench/logprob_linear.py does) within 1.5 GiB; the log-probs equal the Triton path's."""
    T, H, V = 16384, 2880, 201088
    hidden, weight, _, labels, _, _ = make_inputs(T, H, V, torch.bfloat16, False, seed=2)
    h = hidden.cuda().requires_grad_()
    w = weight.cuda().requires_grad_()
    lab = labels.cuda()
    small = [t[:64].detach().clone().requires_grad_() for t in (h, w)]
    lp, ent = cublas_kernel()(small[0], small[1], lab[:64] % 64)
    (lp.sum() + ent.sum()).backward()  # compiles the kernels, allocates cuBLAS's workspaces (not the op's memory)
    del small, lp, ent
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = cublas_kernel()(h, w, lab)
    (lp.sum() + 0.01 * ent.sum()).backward()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 2**30
    assert extra <= 1.5, f"{extra:.3f} GiB"
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    with torch.no_grad():
        lp_t, _ = triton_kernel()(h, w, lab)
    assert relative_error(lp.detach().cpu(), lp_t.cpu()) <= tolerance("algorithms.linear_logprobs", "bfloat16")
