"""The fused lm_head path of the trainer (polyrl.core.models.lm_head) gives the logits path's log-probs,
entropies and parameter gradients for both model families, packed and padded, and never asks for logits."""

from __future__ import annotations

import pytest
import torch
from tiny_policy import BATCH, FAMILIES, tiny_model

from polyrl.backends.cpu import CpuBackend
from polyrl.core.errors import BadInputError
from polyrl.core.models.lm_head import fused_head_problem, fused_kernel_for
from polyrl.core.tolerances import relative_error
from polyrl.core.trainer.batch import policy_forward


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param)


def _run(model, packed: bool, fused: bool):
    model.zero_grad(set_to_none=True)
    kernel = CpuBackend().linear_logprobs if fused else None
    logp, ent = policy_forward(model, BATCH, [0, 1, 2], packed=packed, pad_id=0, temperature=0.7, chunk_size=2,
                               compute_entropy=True, linear_logprobs=kernel)
    w = torch.linspace(-1, 1, logp.numel()).reshape(logp.shape)
    ((logp * w).sum() + (ent * w.flip(-1)).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), ent.detach(), grads


@pytest.mark.parametrize("packed", [True, False])
def test_fused_equals_logits_path(model, packed) -> None:
    assert fused_head_problem(model) == ""
    lp_f, ent_f, g_f = _run(model, packed, fused=True)
    lp_u, ent_u, g_u = _run(model, packed, fused=False)
    assert (lp_f - lp_u).abs().max() < 1e-5 and (ent_f - ent_u).abs().max() < 1e-5
    assert BATCH.mask.bool().logical_not().logical_and(lp_f != 0).sum() == 0  # padding stays zero
    assert g_f.keys() == g_u.keys() and "lm_head.weight" in g_f
    worst = max(relative_error(g_f[k], g_u[k]) for k in g_f)
    assert worst < 1e-5, worst


def test_fused_path_never_makes_logits(model, monkeypatch) -> None:
    """The lm_head multiplies zero positions: its output has no rows."""
    shapes = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    try:
        _run(model, True, fused=True)
    finally:
        handle.remove()
    assert len(shapes) == 1 and shapes[0][1] == 0, shapes


def test_setting_auto_true_false(model, monkeypatch) -> None:
    from polyrl.core.models import lm_head

    backend = CpuBackend()
    assert fused_kernel_for("auto", model, backend) is None  # 17 tokens: the logits are small, no fused kernel
    monkeypatch.setattr(lm_head, "AUTO_MIN_VOCAB", 17)
    assert fused_kernel_for("auto", model, backend) is not None
    assert fused_kernel_for(True, model, backend) is not None
    assert fused_kernel_for(False, model, backend) is None
    model.config.final_logit_softcapping = 30.0
    try:
        assert "final_logit_softcapping=30.0" in fused_head_problem(model)
        assert fused_kernel_for("auto", model, backend) is None  # auto falls back to the logits path
        with pytest.raises(BadInputError, match=r"model\.fused_logprobs=true: its config sets final_logit_softcapping"):
            fused_kernel_for(True, model, backend)
    finally:
        model.config.final_logit_softcapping = None
