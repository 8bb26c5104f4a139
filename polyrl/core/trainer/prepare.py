"""From experience to what the update consumes: token rewards, KL in the reward, advantages, returns.

``prepare_update`` is a pure function of the :class:`~polyrl.core.trainer.experience.Experience` and the
algorithm's settings: it runs no model and changes no state (the adaptive KL controller is *read*; the trainer
updates it with the KL this returns). Under ``--nproc`` its statistics (advantage whitening, metric means)
are those of the global batch, so it is collective, and every rank calls it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from polyrl.core import algorithms as A
from polyrl.core import distributed as D
from polyrl.core.config import AlgorithmConfig
from polyrl.core.trainer.batch import SequenceBatch
from polyrl.core.trainer.experience import Experience
from polyrl.core.trainer.metrics import PrepareMetrics
from polyrl.core.trainer.mismatch import rollout_correction


@dataclasses.dataclass
class UpdateInputs:
    """Everything ``Trainer.update`` needs, as tensors on the batch's device ([B, R] token-level, 0/1 ``batch.mask``)."""

    batch: SequenceBatch
    old_logp: torch.Tensor  # the behaviour policy's log-probs as the trainer computes them (ratio denominators)
    advantages: torch.Tensor
    ref_logp: torch.Tensor | None = None  # for the KL loss (algorithm.use_kl_loss)
    values: torch.Tensor | None = None  # the critic before the update (value clipping), with returns: GAE only
    returns: torch.Tensor | None = None
    reward_kl: float | None = None  # the batch's KL for the adaptive controller (KL in the reward only)
    metrics: PrepareMetrics | None = None  # what prepare_update measured (None for inputs made elsewhere)
    # algorithm.rollout_correction (None when off): the truncated IS weight per token, which multiplies the policy
    # loss, and the 0/1 tokens the actor's update keeps (its loss terms and their token counts use batch.mask ·
    # loss_mask); polyrl.core.trainer.mismatch
    is_weights: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> UpdateInputs:
        """The same inputs on ``device`` (step parity hands the reference's inputs to another backend)."""
        b = self.batch
        moved = SequenceBatch(list(b.prompts), list(b.responses), list(b.group_ids), b.mask.to(device),
                              b.rollout_logp.to(device))
        tensors = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, batch=moved, **{k: v.to(device) for k, v in tensors.items()})


def global_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Masked mean over the tokens of every rank (sum and count all-reduced in fp64): under ``--nproc`` the
    ranks hold different token counts, so an average of per-rank means would not be the batch's mean. The fp64
    sums are taken on the host: exact and cheap on every backend (an NPU computes fp64 slowly, and its collective
    library reduces none: all_reduce_ gathers it), and the same numbers as a CPU run's."""
    m = mask.detach().cpu().to(torch.float64)
    stats = D.all_reduce_(torch.stack([(values.detach().cpu().to(torch.float64) * m).sum(), m.sum()]))
    total, count = stats.tolist()
    return total / max(count, 1.0)


def prepare_update(alg: AlgorithmConfig, exp: Experience, *, kl_ctrl: Any = None) -> UpdateInputs:
    """Token rewards (the sequence score on its last token, minus β·KL when the KL is in the reward) and
    advantages: GAE with the critic's values (whitened over the global batch), or the group-relative
    (GRPO / DAPO) advantage broadcast over the response; the rollout correction's weights and mask from the
    engine's and the trainer's log-probs (``alg.rollout_correction.enable`` resolved: ``Trainer`` does it), and
    the mismatch metrics (when ``alg.old_logprobs`` is "engine", π_old is the engine's μ: no weights, and the
    metrics of ``exp.check_logp`` against μ on the steps that have it). ``exp`` must carry ``old_logp`` (and ``ref_logp`` / ``values`` where the algorithm uses them)."""
    batch = exp.batch
    if batch is None or exp.old_logp is None:
        raise ValueError("prepare_update needs an experience with a batch and its old log-probs (Trainer.collect)")
    mask = batch.mask  # [B, R]
    token_rewards = A.last_token_rewards(exp.scores, mask)  # [B, R]
    reward_kl = kl_coef = None
    if alg.use_kl_in_reward and exp.ref_logp is not None:
        token_rewards, kl_m = A.compute_kl_in_reward(token_rewards, exp.old_logp, exp.ref_logp, mask, kl_ctrl,
                                                     alg.kl_kind, update=False)
        reward_kl, kl_coef = kl_m["kl"], kl_m["kl_coef"]
    returns = None
    if alg.adv_estimator == "gae":
        # whitening statistics are those of the global batch, not of this rank's share
        advantages, returns = A.gae_advantages(token_rewards, exp.values, mask, alg.gamma, alg.lam, whiten=False)
        advantages = A.masked_whiten(advantages, mask, reduce_sum=D.all_reduce_ if D.is_distributed() else None)
    else:
        seq = A.sequence_scores(token_rewards, mask)
        advantages = A.broadcast_to_tokens(A.group_advantages(seq, batch.group_ids, norm_by_std=alg.norm_adv_by_std),
                                           mask)
    if alg.old_logprobs == "engine":  # π_old is μ (resolved by Trainer; the correction is then off): no weights,
        # and the mismatch measured on the drift check's recomputed log-probs, on the steps that have them
        is_weights = loss_mask = mismatch = None
        if exp.check_logp is not None:
            _, _, mismatch = rollout_correction(alg.rollout_correction, exp.check_logp, batch.rollout_logp, mask)
    else:
        is_weights, loss_mask, mismatch = rollout_correction(alg.rollout_correction, exp.old_logp, batch.rollout_logp,
                                                             mask)
    metrics = PrepareMetrics(kl_reward_kl=reward_kl, kl_coef=kl_coef, advantages_mean=global_mean(advantages, mask),
                             advantages_abs_mean=global_mean(advantages.abs(), mask), mismatch=mismatch)
    return UpdateInputs(batch, exp.old_logp, advantages, ref_logp=exp.ref_logp, values=exp.values, returns=returns,
                        reward_kl=reward_kl, metrics=metrics, is_weights=is_weights, loss_mask=loss_mask)
