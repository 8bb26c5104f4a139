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
from polyrl.core.trainer.batch import SequenceBatch, micro_batches, policy_forward, value_forward
from polyrl.core.trainer.experience import TrainingAborted
from polyrl.core.trainer.prepare import UpdateInputs


def _mini_batches(batch: SequenceBatch, size: int, gen: torch.Generator) -> list[list[int]]:
    perm = torch.randperm(batch.size, generator=gen).tolist()
    per_rank = max(1, size // D.get_world_size())
    return [perm[i : i + per_rank] for i in range(0, len(perm), per_rank)]


def _step_or_skip(
    loss_total: float, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, cfg: RunConfig,
    counters: Any, what: str,
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
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, counters: Any, what: str,
) -> dict[str, float]:
    """The shared epoch / mini-batch / micro-batch skeleton; ``micro_loss(rows, n_tok, n_seq)`` does the math."""
    lengths = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]
    sums: dict[str, float] = defaultdict(float)
    n_updates = 0
    for _ in range(cfg.algorithm.ppo_epochs):
        for rows in _mini_batches(batch, cfg.algorithm.mini_batch_size, gen):
            mask = batch.mask[rows]
            n_tok = A.global_token_count(mask)
            n_seq = A.global_seq_count(mask)
            loss_total = 0.0
            for micro in micro_batches(lengths, rows, cfg.algorithm.micro_batch_tokens):
                loss, metrics = micro_loss(micro, n_tok, n_seq)
                loss.backward()
                loss_total += float(loss.detach())
                share = float(batch.mask[micro].sum()) / max(1, n_tok)  # token weight of this micro-batch
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
    """One trained model with what updates it: its optimizer, the CPU generator that shuffles mini-batches,
    the packing of its forward passes, and the counters of skipped (non-finite) updates."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    shuffle_gen: torch.Generator
    counters: Any  # TrainerState.Counters: nonfinite_skipped / nonfinite_in_row
    packed: bool
    pad_id: int
    logprobs: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # the backend's log-prob kernel
    # the backend's fused lm_head + log-prob kernel when model.fused_logprobs selects it (no logits made)
    linear_logprobs: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclasses.dataclass
class UpdateMetrics:
    """What one step's updates report: ``values`` (``loss/*``, ``actor/*``, ``critic/*``, ``time/update_s``), whether
    the actor was updated (not during the critic warmup), and how many optimizer steps were skipped as non-finite."""

    values: dict[str, float]
    actor_updated: bool
    nonfinite_skipped: int


def update_actor(cfg: RunConfig, actor: Learner, inputs: UpdateInputs) -> dict[str, float]:
    """PPO epochs of the policy on ``inputs`` (clipped surrogate, optional KL loss and entropy bonus)."""
    alg = cfg.algorithm
    model = actor.model
    batch, old_logp, ref_logp, advantages = inputs.batch, inputs.old_logp, inputs.ref_logp, inputs.advantages

    def micro_loss(rows: list[int], n_tok: int, n_seq: int) -> tuple[torch.Tensor, dict]:
        logp, ent = policy_forward(
            model, batch, rows, packed=actor.packed, pad_id=actor.pad_id, temperature=cfg.rollout.temperature,
            chunk_size=cfg.trainer.logprob_chunk_size, compute_entropy=alg.entropy_coeff > 0,
            **({"logprobs": actor.logprobs} if actor.logprobs is not None else {}),
            linear_logprobs=actor.linear_logprobs,
        )
        mask, old, adv = batch.mask[rows], old_logp[rows], advantages[rows]
        agg = dict(agg=alg.loss_agg_mode, global_tokens=n_tok, global_seqs=n_seq, max_len=cfg.rollout.max_response_length)
        pg, m = A.policy_loss(logp, old, adv, mask, clip_low=alg.clip_low, clip_high=alg.clip_high,
                              clip_c=alg.clip_c, **agg)
        loss = pg
        metrics = {"pg_clipfrac": m["pg_clipfrac"], "pg_clipfrac_lower": m["pg_clipfrac_lower"], "ppo_kl": m["ppo_kl"]}
        with torch.no_grad():  # which side of the clip range was hit (DAPO clip-higher makes them differ)
            ratio = torch.exp(logp.detach() - old)
            metrics["clipfrac_low"] = A.masked_mean(((adv < 0) & (ratio < 1 - alg.clip_low)).float(), mask)
            metrics["clipfrac_high"] = A.masked_mean(((adv > 0) & (ratio > 1 + alg.clip_high)).float(), mask)
        policy_share = pg.detach()
        if alg.use_kl_loss and ref_logp is not None:
            kl = A.kl_penalty(logp, ref_logp[rows], alg.kl_kind)
            kl_loss = A.aggregate(kl, mask, **agg)
            loss = loss + alg.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach() * n_tok / max(1.0, float(mask.sum()))
        if alg.entropy_coeff > 0:
            ent_loss = A.entropy_loss(ent, mask, **agg)
            loss = loss - alg.entropy_coeff * ent_loss
        metrics["policy_loss_share"] = policy_share * n_tok / max(1.0, float(mask.sum()))
        return loss, metrics

    out = _run_epochs(cfg, batch, actor.shuffle_gen, micro_loss, list(model.parameters()), actor.optimizer,
                      actor.counters, "actor")
    metrics = {f"actor/{k}": v for k, v in out.items() if k not in ("policy_loss_share", "kl_loss", "loss")}
    metrics["loss/policy"] = out.get("policy_loss_share", 0.0)
    metrics["loss/total"] = out.get("loss", 0.0)
    if "kl_loss" in out:
        metrics["loss/kl"] = out["kl_loss"]
    return metrics


def update_critic(cfg: RunConfig, learner: Learner, inputs: UpdateInputs) -> dict[str, float]:
    """PPO epochs of the critic towards ``inputs.returns`` (value clipping around ``inputs.values``)."""
    alg = cfg.algorithm
    critic = learner.model
    batch, old_values, returns = inputs.batch, inputs.values, inputs.returns

    def micro_loss(rows: list[int], n_tok: int, n_seq: int) -> tuple[torch.Tensor, dict]:
        values = value_forward(critic, batch, rows, packed=learner.packed, pad_id=learner.pad_id)
        mask = batch.mask[rows]
        loss, m = A.value_loss(values, old_values[rows], returns[rows], mask, clip=alg.value_clip,
                               agg=alg.loss_agg_mode, global_tokens=n_tok, global_seqs=n_seq,
                               max_len=cfg.rollout.max_response_length)
        return loss, {"vf_clipfrac": m["vf_clipfrac"], "vpred_mean": m["vpred_mean"]}

    out = _run_epochs(cfg, batch, learner.shuffle_gen, micro_loss, list(critic.parameters()),
                      learner.optimizer, learner.counters, "critic")
    metrics = {f"critic/{k}": v for k, v in out.items() if k != "loss"}
    metrics["loss/value"] = out.get("loss", 0.0)
    return metrics
