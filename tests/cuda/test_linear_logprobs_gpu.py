"""The cuda backend's fused lm_head + log-prob + entropy on a real GPU: bf16/fp16 against fp64 through the full
logits (the bars of polyrl.core.tolerances, derived from the reference's error), the same gradients as the core
reference, and the GPT-OSS-20B width (H 2880, V 201088) forward against the reference. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from linear_logprobs_cases import make_inputs, run_with_grads, triton_kernel

from polyrl.core.algorithms.linear_logprobs import linear_logprobs_and_entropy
from polyrl.core.tolerances import relative_error, tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N,H,V,with_bias", [(1000, 256, 5001, False), (333, 128, 3000, True)])
def test_triton_vs_fp64_full_logits(N, H, V, with_bias, dtype) -> None:
    args = make_inputs(N, H, V, dtype, with_bias)
    tau = 0.7
    got = run_with_grads(triton_kernel(), *args, tau, device="cuda", chunk_size=256)
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


def test_gpt_oss_width_forward_matches_reference() -> None:
    """H 2880, V 201088, bf16: the Triton statistics equal the chunked reference's within the bf16 bar."""
    hidden, weight, _, labels, _, _ = make_inputs(512, 2880, 201088, torch.bfloat16, False, seed=1)
    h, w, lab = hidden.cuda(), weight.cuda(), labels.cuda()
    with torch.no_grad():
        lp, ent = triton_kernel()(h, w, lab, temperature=1.0)
        lp_ref, ent_ref = linear_logprobs_and_entropy(h, w, lab, chunk_size=512)
    for g, r in ((lp, lp_ref), (ent, ent_ref)):
        assert torch.isfinite(g).all()
        err = relative_error(g.cpu(), r.cpu())
        assert err <= tolerance("algorithms.linear_logprobs", "bfloat16"), err


@pytest.mark.parametrize("name", ["gpt_oss_tiny", "deepseek_v3_tiny"])
def test_trainer_fused_path_equals_logits_path_on_gpu(name) -> None:
    """Both model families, packed, fp32 on the GPU: the trainer's fused path through the Triton kernel gives the
    logits path's log-probs, entropies and parameter gradients."""
    from polyrl.core.models import build_model
    from polyrl.core.trainer.batch import SequenceBatch, policy_forward

    model = build_model(name, vocab_size=17, seed=0).cuda()
    batch = SequenceBatch.from_rollout(
        prompts=[[1, 5, 6], [1, 7], [1, 8, 9, 10]], responses=[[3, 4, 2], [11, 12, 13, 14], [15]],
        logprobs=[[0.0] * 3, [0.0] * 4, [0.0]], group_ids=[0, 0, 1], device="cuda")
    outs = []
    for kernel in (triton_kernel(), None):
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
