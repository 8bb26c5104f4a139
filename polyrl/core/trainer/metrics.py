"""What a step reports, typed: one record per stage, each field the source of one metric's name.

A field is its metric: ``reward_mean`` is ``reward/mean`` (the part before the first underscore is the namespace,
and no namespace has an underscore). ``None`` is a metric this step does not have: the KL terms without a
reference model, the actor's during the critic warmup, every model-side metric when dynamic sampling kept
nothing. A field holding a record contributes that record's metrics; one holding a mapping is already flat
(the weight sync's metrics, ``Trainer.sync_engine``, and the backend's memory metrics come as dicts).
:func:`flatten` turns a step's record into the ``{name: float}`` of one ``metrics.jsonl`` line, once, where the
step's metrics are reduced over ranks and handed to the log.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


def metric_name(field: str) -> str:
    """``reward_mean`` -> ``reward/mean``, ``actor_pg_clipfrac`` -> ``actor/pg_clipfrac``."""
    namespace, _, name = field.partition("_")
    return f"{namespace}/{name}"


def flatten(record: Any) -> dict[str, float]:
    """The metrics of ``record`` (a record of this module) as one flat dict, in field order; ``None`` omitted."""
    out: dict[str, float] = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if value is None:
            continue
        if dataclasses.is_dataclass(value):
            out.update(flatten(value))
        elif isinstance(value, Mapping):
            out.update({k: float(v) for k, v in value.items()})
        else:
            out[metric_name(f.name)] = float(value)
    return out


@dataclasses.dataclass
class RolloutMetrics:
    """Every sample generated this step (before dynamic sampling, over all ranks) and the step's rollout counts
    (:class:`~polyrl.core.trainer.experience.RolloutCounts`)."""

    reward_mean: float  # the task's own score (before overlong shaping)
    reward_max: float
    reward_min: float
    reward_shaped_mean: float  # task score + overlong penalty: what the update learns from
    reward_errors: int  # rewards that raised (scored as the task's failure score)
    reward_timeouts: int
    response_length_mean: float  # tokens
    response_length_max: float
    response_clip_ratio: float  # share of responses cut at rollout.max_response_length
    dapo_overlong_penalized: int  # sequences with a negative overlong penalty
    dapo_overlong_penalty_mean: float
    prompt_truncated: int  # prompts cut to data.max_prompt_length
    dapo_gen_batches: int  # generation batches drawn (> 1 only under dynamic sampling)
    dapo_groups_filtered: int
    dapo_groups_kept: int
    time_rollout_s: float


@dataclasses.dataclass
class ViewMetrics:
    """The trainer's views of the sampled tokens (``Trainer.collect``): old and reference log-probs."""

    batch_tokens: int  # prompt + response tokens of this rank's rows (summed over ranks when logged)
    # mean |trainer - engine| log-prob over the response tokens, and the actor's entropy there: from the trainer's
    # old-log-prob forward, so None on the steps that take the engine's log-probs as π_old without the check
    rollout_logprob_diff: float | None
    actor_entropy: float | None
    kl_actor_ref: float | None  # k1 KL of the actor from the reference (None without a reference)
    time_old_logprob_s: float  # the actor's, reference's and critic's forwards
    # rollout.routing_replay=r3: share of (token, MoE layer) pairs whose replayed experts (the engine's) are not the
    # set the trainer's router would pick itself there, in the old-log-prob pass; None without engine routes
    rollout_routing_mismatch: float | None = None


@dataclasses.dataclass
class MismatchMetrics:
    """The engine's sampling policy μ against the trainer's π_old on the sampled response tokens, and what the
    rollout correction does with them (``polyrl.core.trainer.mismatch``; logged whether it is applied or not).
    Token figures are over every valid token of the global batch, sequence figures over its sequences."""

    mismatch_applied: int  # 1 when algorithm.rollout_correction is on (resolved), 0: metrics only
    mismatch_k1: float  # mean of log μ − log π_old: the k1 estimate of KL(μ ‖ π_old) per token
    mismatch_k3: float  # mean of r − 1 − log r, r = π_old/μ: the k3 estimate (≥ 0)
    mismatch_seq_k1: float  # mean over sequences of their summed k1 (− log of the sequence ratio)
    mismatch_is_mean: float  # the truncated weight w per token (is_level's, token level when is_level is null)
    mismatch_is_max: float  # the largest raw weight ρ (before the cap)
    mismatch_is_clipped_frac: float  # tokens with ρ > is_cap
    mismatch_masked_frac: float  # tokens dropped by token_mask_band or seq_reject
    mismatch_seq_is_mean: float  # each sequence's mean w, averaged over sequences
    mismatch_seq_is_max: float  # the largest sequence mean of ρ
    mismatch_seq_clipped_frac: float  # sequences with a token whose ρ > is_cap
    mismatch_seq_masked_frac: float  # sequences with a dropped token (all of them, for a rejected one)


@dataclasses.dataclass
class PrepareMetrics:
    """``prepare_update``: the KL in the reward and the advantages; the train / rollout mismatch."""

    kl_reward_kl: float | None  # None unless algorithm.use_kl_in_reward
    kl_coef: float | None
    advantages_mean: float
    advantages_abs_mean: float
    mismatch: MismatchMetrics | None = None  # None for records made elsewhere


@dataclasses.dataclass
class CriticMetrics:
    """The critic's PPO epochs: averages over its optimizer steps (token-weighted within each)."""

    critic_vf_clipfrac: float  # share of tokens where the clipped value error was the larger
    critic_vpred_mean: float
    critic_grad_norm: float  # before clipping
    loss_value: float
    critic_explained_var: float  # of the returns by the values before the update


@dataclasses.dataclass
class ActorMetrics:
    """The actor's PPO epochs: averages over its optimizer steps (token-weighted within each). The clip
    fractions describe the ratio the loss uses (``A.policy_loss``: clamped log-ratio)."""

    actor_pg_clipfrac: float  # tokens where the clipped surrogate was taken
    actor_pg_clipfrac_lower: float  # tokens where the dual-clip bound was taken
    actor_ppo_kl: float  # mean of old - new log-prob
    actor_clipfrac_low: float  # A < 0 and ratio < 1 - clip_low
    actor_clipfrac_high: float  # A > 0 and ratio > 1 + clip_high (DAPO's clip-higher makes them differ)
    actor_grad_norm: float  # before clipping
    loss_policy: float  # the policy term alone (global token-mean share)
    loss_total: float  # the optimised loss (policy + KL loss - entropy bonus)
    loss_kl: float | None  # None unless algorithm.use_kl_loss
    # rollout.routing_replay on: share of (token, MoE layer) pairs of the update's forwards whose replayed experts are
    # not the set the router picks there now (the policy moved since the routes were taken); None when off
    actor_routing_changed: float | None = None


@dataclasses.dataclass
class UpdateMetrics:
    """``Trainer.update``: the critic's epochs (None without a critic), then the actor's (None during the
    critic warmup)."""

    critic: CriticMetrics | None
    actor: ActorMetrics | None
    time_update_s: float


@dataclasses.dataclass
class StepMetrics:
    """One step, every stage; flattened into one ``metrics.jsonl`` line (``Trainer.step``)."""

    rollout: RolloutMetrics
    views: ViewMetrics | None  # None (as everything model-side) when dynamic sampling kept nothing
    prepare: PrepareMetrics | None
    time_prepare_s: float | None  # from the old log-probs to the advantages, as in polyrl 0.1
    update: UpdateMetrics | None
    actor_lr: float  # the LR the step's updates used
    sync: Mapping[str, float]  # ``Trainer.sync_engine``: time/sync_s, the probe's rollout/sync_* (verified engines)
    train_nonfinite_skipped: int  # updates skipped as non-finite since the run began (checkpointed)
    train_skipped_no_data: int  # 1 when dynamic sampling kept nothing
    time_step_s: float
    memory: Mapping[str, float]  # ``Backend.memory_metrics``
