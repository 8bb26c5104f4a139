"""PPO updates: several epochs of shuffled mini-batches, packed micro-batches, a global token-mean.

Each mini-batch is one optimizer step. Its loss is the sum over micro-batches (and, under FSDP, over
ranks) of each micro-batch's *share* of the mini-batch aggregate: ``A.policy_loss(..., global_tokens=N)``
with N the valid tokens of the whole mini-batch on all ranks, so the gradient does not depend on how the
mini-batch was split. Before stepping, the grad norm is measured and clipped; a non-finite loss or grad
norm skips the step (gradients dropped), is counted, and ``max_nonfinite_in_row`` skips in a row abort
the run.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from polyrl.core import algorithms as A
from polyrl.core import distributed as D
from polyrl.core.config import RunConfig
from polyrl.core.distributed.sharding import clip_grad_norm
from polyrl.core.run.outcome import TrainingAborted
from polyrl.core.trainer.batch import SequenceBatch, micro_batches, policy_forward, value_forward
from polyrl.core.trainer.metrics import ActorMetrics, CriticMetrics, UpdateMetrics
from polyrl.core.trainer.prepare import UpdateInputs
from polyrl.core.trainer.state import Counters

__all__ = ["Learner", "UpdateMetrics", "update_actor", "update_critic"]


def _mini_batches(batch: SequenceBatch, size: int, gen: torch.Generator) -> list[list[int]]:
    perm = torch.randperm(batch.size, generator=gen).tolist()
    per_rank = max(1, size // D.get_world_size())
    return [perm[i : i + per_rank] for i in range(0, len(perm), per_rank)]


def _step_or_skip(
    loss_total: float, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, cfg: RunConfig,
    counters: Counters, what: str,
) -> float:
    """Clip and step, or drop the gradients of a non-finite update. Returns the pre-clip grad norm."""
    grad_norm = float(clip_grad_norm(params, cfg.optimizer.grad_clip))
    if math.isfinite(loss_total) and math.isfinite(grad_norm):
        optimizer.step()
        counters.nonfinite_in_row = 0
    else:
        counters.nonfinite_skipped += 1
        counters.nonfinite_in_row += 1
        if counters.nonfinite_in_row >= cfg.trainer.max_nonfinite_in_row:
            raise TrainingAborted(
                f"{what} update: loss {loss_total} / grad norm {grad_norm} not finite for "
                f"{counters.nonfinite_in_row} updates in a row (trainer.max_nonfinite_in_row="
                f"{cfg.trainer.max_nonfinite_in_row}); stopping without writing a checkpoint of this state. "
                "Lower optimizer.lr or check the data."
            )
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _run_epochs(
    cfg: RunConfig, batch: SequenceBatch, gen: torch.Generator, micro_loss: Callable[..., tuple[torch.Tensor, dict]],
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, counters: Counters, what: str,
    token_mask: torch.Tensor | None = None,
) -> dict[str, float]:
    """The shared epoch / mini-batch / micro-batch skeleton; ``micro_loss(rows, n_tok, n_seq)`` does the math.
    ``token_mask`` ([B, R], default ``batch.mask``): the tokens the losses count (the rollout correction's kept
    ones); a mini-batch with none of them on any rank is skipped (no optimizer step: there is nothing to learn)."""
    lengths = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]
    tmask = batch.mask if token_mask is None else token_mask
    sums: dict[str, float] = defaultdict(float)
    n_updates = 0
    for _ in range(cfg.algorithm.ppo_epochs):
        for rows in _mini_batches(batch, cfg.algorithm.mini_batch_size, gen):
            mask = tmask[rows]
            n_tok = A.global_token_count(mask)
            n_seq = A.global_seq_count(mask)
            if n_tok == 0 and token_mask is not None:
                continue
            loss_total = 0.0
            for micro in micro_batches(lengths, rows, cfg.algorithm.micro_batch_tokens):
                loss, metrics = micro_loss(micro, n_tok, n_seq)
                loss.backward()
                loss_total += float(loss.detach())
                share = float(tmask[micro].sum()) / max(1, n_tok)  # token weight of this micro-batch
                for k, v in metrics.items():
                    sums[k] += float(v) * share
            loss_total = D.all_reduce_(torch.tensor(loss_total, dtype=torch.float64)).item()
            sums["grad_norm"] += _step_or_skip(loss_total, params, optimizer, cfg, counters, what)
            sums["loss"] += loss_total
            n_updates += 1
    # Token-share-weighted metrics are this rank's share of the global value: sum them over ranks here
    # (grad_norm and loss are already global), so every rank returns the global numbers.
    shares = D.all_reduce_metrics({k: v for k, v in sums.items() if k not in ("grad_norm", "loss")}, op="sum")
    sums.update(shares)
    return {k: v / max(1, n_updates) for k, v in sums.items()}


@dataclasses.dataclass
class Learner:
    """One trained model with what updates it: its optimizer, the CPU generator that shuffles mini-batches and
    the packing of its forward passes (the counters of skipped updates are the run's: ``TrainerState``)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    shuffle_gen: torch.Generator
    packed: bool
    pad_id: int
    logprobs: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # the backend's log-prob kernel
    # the backend's fused lm_head + log-prob kernel when model.fused_logprobs selects it (no logits made)
    linear_logprobs: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # rollout.routing_replay on: the hooks on the model's routers (polyrl.core.models.routing.RouterReplay)
    replay: Any = None
    # model.fused_loss on (with the fused path): the backend's fused log-prob op that takes the actor loss's
    # gradient inside its forward (Backend.linear_logprob_loss)
    linear_logprob_loss: Callable[..., tuple[torch.Tensor, ...]] | None = None

    def policy_kwargs(self, cfg: RunConfig) -> dict[str, Any]:
        """How this model's ``policy_forward`` runs everywhere — old and reference log-probs, the update, the
        sync probe (which drops the temperature): packing, the sampling temperature, the log-prob kernels."""
        kernels = {"logprobs": self.logprobs} if self.logprobs is not None else {}  # else the reference kernel
        if self.replay is not None:  # every forward of the model then declares its routing (batch.routes or its own)
            kernels["replay"] = self.replay
        return dict(packed=self.packed, pad_id=self.pad_id, temperature=cfg.rollout.temperature,
                    chunk_size=cfg.trainer.logprob_chunk_size, linear_logprobs=self.linear_logprobs, **kernels)


def update_actor(cfg: RunConfig, actor: Learner, inputs: UpdateInputs, counters: Counters) -> ActorMetrics:
    """PPO epochs of the policy on ``inputs`` (clipped surrogate, optional KL loss and entropy bonus)."""
    alg = cfg.algorithm
    model = actor.model
    batch, old_logp, ref_logp, advantages = inputs.batch, inputs.old_logp, inputs.ref_logp, inputs.advantages
    forward = actor.policy_kwargs(cfg)
    # the rollout correction (UpdateInputs): the kept tokens replace the response mask in every actor loss term
    # and its counts; the IS weights multiply the policy loss per token
    token_mask = batch.mask if inputs.loss_mask is None else batch.mask * inputs.loss_mask
    is_weights = inputs.is_weights

    def micro_loss(rows: list[int], n_tok: int, n_seq: int) -> tuple[torch.Tensor, dict]:
        mask, old, adv = token_mask[rows], old_logp[rows], advantages[rows]
        totals = dict(global_tokens=n_tok, global_seqs=n_seq, max_len=cfg.rollout.max_response_length)
        agg = dict(agg=alg.loss_agg_mode, **totals)
        weights = None if is_weights is None else is_weights[rows]
        ref = ref_logp[rows] if alg.use_kl_loss and ref_logp is not None else None

        def terms(logp: torch.Tensor, ent: torch.Tensor, shares: bool = True) -> tuple[torch.Tensor, dict]:
            # the clip fractions come with the loss: they describe its ratio (clamped log-ratio). ``shares``: the
            # loss shares' metrics (one host read of the mask's count; not per chunk of the fused loss)
            pg, metrics = A.policy_loss(logp, old, adv, mask, clip_low=alg.clip_low, clip_high=alg.clip_high,
                                        clip_c=alg.clip_c, weights=weights, **agg)
            loss = pg
            if ref is not None:
                kl_loss = A.aggregate(A.kl_penalty(logp, ref, alg.kl_kind), mask, alg.loss_agg_mode, **totals)
                loss = loss + alg.kl_loss_coef * kl_loss
                if shares:
                    metrics["kl_loss"] = kl_loss.detach() * n_tok / max(1.0, float(mask.sum()))
            if alg.entropy_coeff > 0:
                loss = loss - alg.entropy_coeff * A.entropy_loss(ent, mask, **agg)
            if shares:
                metrics["policy_loss_share"] = pg.detach() * n_tok / max(1.0, float(mask.sum()))
            return loss, metrics

        want_entropy = alg.entropy_coeff > 0
        if actor.linear_logprob_loss is None:
            logp, ent = policy_forward(model, batch, rows, **forward, compute_entropy=want_entropy)  # [b, R]
            return terms(logp, ent)
        # model.fused_loss: the loss's gradient taken inside the fused op (a sum of per-token terms, as above);
        # its value and metrics from the op's log-probs, the anchor carrying the gradients
        anchor, logp, ent = policy_forward(model, batch, rows, **forward, compute_entropy=want_entropy,
                                           linear_logprob_loss=actor.linear_logprob_loss,
                                           loss_terms=lambda lp, en: terms(lp, en, shares=False)[0])
        with torch.no_grad():
            loss, metrics = terms(logp, ent)
        return loss + anchor, metrics

    if actor.replay is not None:
        actor.replay.reset_counts()
    out = _run_epochs(cfg, batch, actor.shuffle_gen, micro_loss, list(model.parameters()), actor.optimizer,
                      counters, "actor", token_mask=None if inputs.loss_mask is None else token_mask)
    out = defaultdict(float, out)  # every mini-batch skipped (the correction kept no token): zeros
    replayed = actor.replay is not None and batch.routes is not None and actor.replay.forced > 0
    return ActorMetrics(
        actor_pg_clipfrac=out["pg_clipfrac"], actor_pg_clipfrac_lower=out["pg_clipfrac_lower"],
        actor_ppo_kl=out["ppo_kl"], actor_clipfrac_low=out["clipfrac_low"], actor_clipfrac_high=out["clipfrac_high"],
        actor_grad_norm=out["grad_norm"], loss_policy=out.get("policy_loss_share", 0.0),
        loss_total=out.get("loss", 0.0), loss_kl=out.get("kl_loss"),
        actor_routing_changed=actor.replay.changed / actor.replay.forced if replayed else None,  # this rank's
    )


def update_critic(cfg: RunConfig, critic: Learner, inputs: UpdateInputs, counters: Counters) -> CriticMetrics:
    """PPO epochs of the critic towards ``inputs.returns`` (value clipping around ``inputs.values``)."""
    alg = cfg.algorithm
    batch, old_values, returns = inputs.batch, inputs.values, inputs.returns

    def micro_loss(rows: list[int], n_tok: int, n_seq: int) -> tuple[torch.Tensor, dict]:
        values = value_forward(critic.model, batch, rows, packed=critic.packed, pad_id=critic.pad_id)  # [b, R]
        mask = batch.mask[rows]
        loss, m = A.value_loss(values, old_values[rows], returns[rows], mask, clip=alg.value_clip,
                               agg=alg.loss_agg_mode, global_tokens=n_tok, global_seqs=n_seq,
                               max_len=cfg.rollout.max_response_length)
        return loss, {"vf_clipfrac": m["vf_clipfrac"], "vpred_mean": m["vpred_mean"]}

    out = _run_epochs(cfg, batch, critic.shuffle_gen, micro_loss, list(critic.model.parameters()),
                      critic.optimizer, counters, "critic")
    return CriticMetrics(
        critic_vf_clipfrac=out["vf_clipfrac"], critic_vpred_mean=out["vpred_mean"], critic_grad_norm=out["grad_norm"],
        loss_value=out.get("loss", 0.0),
        critic_explained_var=_explained_variance(old_values, returns, batch.mask),
    )


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the masked tokens of this rank ([B, R] each)."""
    var_r = float(A.masked_mean((returns - A.masked_mean(returns, mask)) ** 2, mask))
    resid = returns - values
    var_e = float(A.masked_mean((resid - A.masked_mean(resid, mask)) ** 2, mask))
    return 1.0 - var_e / var_r if var_r > 0 and math.isfinite(var_r) else 0.0
