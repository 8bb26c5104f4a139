"""What the fused lm_head path's tests share (tests/models/test_models_lm_head.py, tests/trainer/test_fused_loss.py,
tests/cuda/test_fused_loss_gpu.py): three rows of prompts and responses of different lengths (17-token vocabulary),
the two tiny model families, and one actor-loss step through the fused log-probs with or without the fused loss."""

from __future__ import annotations

import torch

from polyrl.core import algorithms as A
from polyrl.core.models import build_model
from polyrl.core.trainer.batch import SequenceBatch, policy_forward

BATCH = SequenceBatch.from_rollout(
    prompts=[[1, 5, 6], [1, 7], [1, 8, 9, 10]], responses=[[3, 4, 2], [11, 12, 13, 14], [15]],
    logprobs=[[0.0] * 3, [0.0] * 4, [0.0]], group_ids=[0, 0, 1])
FAMILIES = ["gpt_oss_tiny", "deepseek_v3_tiny"]


def tiny_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name, vocab_size=17, seed=0)


def loss_terms(logp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
    """The actor loss's shape on BATCH: clipped surrogate (seq-mean-token-mean), k3 KL, entropy bonus."""
    mask = BATCH.mask.to(logp.device)
    old = torch.full_like(mask, -2.5)
    adv = torch.linspace(-1.0, 1.0, mask.numel(), device=mask.device).reshape(mask.shape)
    agg = dict(global_tokens=8, global_seqs=3, max_len=4)
    pg, _ = A.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg="seq-mean-token-mean", **agg)
    kl = A.aggregate(A.kl_penalty(logp, old + 0.1, "low_var_kl"), mask, "seq-mean-token-mean", **agg)
    return pg + 0.05 * kl - 0.01 * A.entropy_loss(ent, mask, agg="seq-mean-token-mean", **agg)


def fused_loss_step(model: torch.nn.Module, backend, packed: bool, fused_loss: bool):
    """(loss, logp, ent, parameter gradients) of :func:`loss_terms` on BATCH through ``backend``'s fused log-probs,
    its gradient through the op's backward (``fused_loss`` false) or taken inside the op's forward (true)."""
    model.zero_grad(set_to_none=True)
    kw = dict(packed=packed, pad_id=0, temperature=0.7, chunk_size=2, compute_entropy=True,
              linear_logprobs=backend.linear_logprobs)
    if fused_loss:
        anchor, logp, ent = policy_forward(model, BATCH, [0, 1, 2], **kw, linear_logprob_loss=backend.linear_logprob_loss,
                                           loss_terms=loss_terms)
        assert not logp.requires_grad and anchor.requires_grad
        with torch.no_grad():
            value = loss_terms(logp, ent)
        loss = value + anchor
    else:
        logp, ent = policy_forward(model, BATCH, [0, 1, 2], **kw)
        loss = loss_terms(logp, ent)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), logp.detach(), ent.detach(), grads
