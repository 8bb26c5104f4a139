"""From prompts to a scored training batch: rollout → reward → overlong shaping → DAPO dynamic sampling.

:func:`sample_experience` draws ``data.batch_size`` prompts (this rank takes its contiguous slice), samples
``rollout.n`` responses each, scores them with the task (a reward that raises or times out scores as
failure and is counted), adds the DAPO overlong penalty, and — with dynamic sampling on — keeps only groups
whose metric varies, drawing new generation batches until enough groups are kept or
``max_num_gen_batches`` is reached (then "error" stops the run with DAPO's message, "train" trains on
what was kept).

Rows travel as :class:`Generation` (typed per-sequence lists and [B] tensors), counters as the integer
fields of :class:`RolloutCounts`; the metrics (:class:`~polyrl.core.trainer.metrics.RolloutMetrics`) are derived
from both, never the other way round. The trainer's
``collect()`` adds the model-side views of the sampled tokens (old and reference log-probs, values) to
the :class:`Experience` this module returns.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from polyrl.core import algorithms as A
from polyrl.core import distributed as D
from polyrl.core.config import RunConfig
from polyrl.core.models.chat import encode_prompt
from polyrl.core.rewards import score_batch
from polyrl.core.rollout import RolloutEngine, SamplingParams
from polyrl.core.run.faults import EngineFailed, RewardsFailing
from polyrl.core.run.outcome import TrainingAborted
from polyrl.core.trainer.batch import SequenceBatch
from polyrl.core.trainer.metrics import RolloutMetrics, ViewMetrics


@dataclasses.dataclass
class Rollout:
    """What generation needs, built once by the trainer: the task (prompts and scores), the tokenizer, the
    engine and its sampling parameters, the CPU generator of per-sequence sampling seeds, and the device the
    training batch is built on (``Backend.device``)."""

    task: Any
    tokenizer: Any
    engine: RolloutEngine
    sampling: SamplingParams
    sample_gen: torch.Generator
    task_rng: Any  # random.Random of the prompt stream
    device: torch.device
    # generation batches in a row in which every reward failed (the data.reward_max_failures_in_row rule); not
    # checkpointed: a resumed run counts afresh
    reward_failures_in_row: int = 0


@dataclasses.dataclass
class Generation:
    """Sequences of one or more generation batches: per-sequence lists, [B] CPU tensors, and counts."""

    prompts: list[list[int]]
    responses: list[list[int]]
    logprobs: list[list[float]]  # the engine's sampling log-probs per response token
    group_ids: list[Any]
    finish: list[str]  # "stop" | "length"
    raw: torch.Tensor  # [B] the task's scores
    penalty: torch.Tensor  # [B] DAPO overlong penalty (<= 0; zeros when off)
    lengths: torch.Tensor  # [B] response lengths (float)
    reward_errors: int = 0
    reward_timeouts: int = 0
    truncated: int = 0  # prompts cut to data.max_prompt_length
    reward_failure: str = ""  # why the last failed reward failed ("" when none did)
    routes: list[Any] | None = None  # the engine's routed experts per sequence (rollout.routing_replay=r3)

    @property
    def shaped(self) -> torch.Tensor:
        """[B] the scores the update learns from: task score + overlong penalty."""
        return self.raw + self.penalty

    @property
    def size(self) -> int:
        return len(self.prompts)

    def select(self, rows: list[int]) -> Generation:
        """The sequences ``rows`` (counts are of the generation, not of a selection: zero here)."""
        idx = torch.tensor(rows, dtype=torch.long)
        return Generation(*([getattr(self, k)[i] for i in rows] for k in _ROW_FIELDS),
                          *(getattr(self, k)[idx] for k in _TENSOR_FIELDS),
                          routes=None if self.routes is None else [self.routes[i] for i in rows])

    @staticmethod
    def concat(parts: list[Generation]) -> Generation:
        """Rows of ``parts`` in order; counts summed."""
        if not parts:
            return Generation([], [], [], [], [], torch.zeros(0), torch.zeros(0), torch.zeros(0))
        return Generation(*([x for p in parts for x in getattr(p, k)] for k in _ROW_FIELDS),
                          *(torch.cat([getattr(p, k) for p in parts]) for k in _TENSOR_FIELDS),
                          *(sum(getattr(p, k) for p in parts) for k in _COUNT_FIELDS),
                          next((p.reward_failure for p in reversed(parts) if p.reward_failure), ""),
                          routes=None if parts[0].routes is None else [x for p in parts for x in p.routes])


_ROW_FIELDS = ("prompts", "responses", "logprobs", "group_ids", "finish")
_TENSOR_FIELDS = ("raw", "penalty", "lengths")
_COUNT_FIELDS = ("reward_errors", "reward_timeouts", "truncated")


@dataclasses.dataclass
class RolloutCounts:
    """What one step's rollout counted, over every rank's sequences (identical on every rank)."""

    gen_batches: int = 0  # generation batches drawn (> 1 only under dynamic sampling)
    groups_filtered: int = 0  # groups dropped by dynamic sampling (same metric for every sample)
    groups_kept: int = 0
    overlong_penalized: int = 0  # sequences with a negative overlong penalty
    reward_errors: int = 0  # rewards that raised (scored as the task's failure score)
    reward_timeouts: int = 0
    truncated_prompts: int = 0


@dataclasses.dataclass
class Experience:
    """One step's training data on this rank. ``batch`` is None when dynamic sampling kept nothing.

    [B] and [B, R] tensors live on the batch's device. ``old_logp`` / ``ref_logp`` / ``values`` are the trainer's
    views of the sampled tokens (filled by ``Trainer.collect``, with ``view_metrics``; None when not computed or
    not configured)."""

    batch: SequenceBatch | None
    scores: torch.Tensor  # [B] shaped sequence scores (task score + overlong penalty)
    counts: RolloutCounts
    metrics: RolloutMetrics
    old_logp: torch.Tensor | None = None  # [B, R] the actor before the update (the behaviour policy's log-probs)
    ref_logp: torch.Tensor | None = None  # [B, R] the frozen reference (KL terms)
    values: torch.Tensor | None = None  # [B, R] the critic before the update (GAE)
    view_metrics: ViewMetrics | None = None  # of the three views above (Trainer.collect)
    # [B, R] the trainer's recomputed log-probs when ``old_logp`` is the engine's (algorithm.old_logprobs=engine) and
    # this step runs the drift check; the mismatch metrics are measured on them. None otherwise.
    check_logp: torch.Tensor | None = None


def decode_response(tokenizer: Any, ids: list[int], stop_ids: set[int]) -> str:
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True)


def _row_seeds(gen: torch.Generator, first_row: int, count: int) -> list[int]:
    """Per-sequence sampling seeds from one draw of the shared generator (identical on every rank) and
    the sequence's index in the global batch: the same sequence gets the same seed whatever the rank
    count, so an N-process run samples exactly what the 1-process run samples."""
    base = int(torch.randint(0, 2**62, (1,), generator=gen))
    return [(base ^ ((first_row + i + 1) * 0x9E3779B97F4A7C15)) & (2**63 - 1) for i in range(count)]


def _generate_and_score(cfg: RunConfig, ro: Rollout, examples: list, first_row: int = 0) -> Generation:
    """One generation batch on this rank: per sequence prompt, response, logprobs, group, score.

    ``first_row``: global index of this rank's first sequence (for the per-sequence sampling seeds).
    """
    tok, n = ro.tokenizer, cfg.rollout.n
    prompts = []
    truncated = 0
    for ex in examples:
        ids = encode_prompt(tok, ex.prompt, fmt=cfg.data.prompt_format, meta=ex.meta)
        if len(ids) > cfg.data.max_prompt_length:  # keep the end: the question is usually last
            ids, truncated = ids[-cfg.data.max_prompt_length :], truncated + 1
        prompts.append(ids)
    seq_prompts = [p for p in prompts for _ in range(n)]
    seq_examples = [ex for ex in examples for _ in range(n)]
    seeds = _row_seeds(ro.sample_gen, first_row, len(seq_prompts))
    try:
        out = ro.engine.generate(seq_prompts, ro.sampling, row_seeds=seeds)
    except torch.OutOfMemoryError:
        raise  # device memory: the trainer's own line (phase, micro-batch, recipe key)
    except Exception as exc:  # the engine's own failure (a stop signal is a BaseException: not caught)
        raise EngineFailed(ro.engine.name, exc) from exc
    stop = set(ro.sampling.stop_token_ids)
    texts = [decode_response(tok, r, stop) for r in out.response_ids]
    raw, stats = score_batch(ro.task, seq_examples, texts, timeout_s=cfg.data.reward_timeout_s)
    lengths = torch.tensor([len(r) for r in out.response_ids], dtype=torch.float32)
    raw_t = torch.tensor(raw, dtype=torch.float32)
    ov = cfg.algorithm.overlong
    penalty = (
        A.overlong_penalty(lengths, cfg.rollout.max_response_length, ov.buffer_length, ov.penalty_factor)
        if ov.enable else torch.zeros_like(raw_t)
    )
    return Generation(seq_prompts, out.response_ids, out.logprobs, [ex.group_id for ex in seq_examples],
                      out.finish_reasons, raw_t, penalty, lengths, reward_errors=stats.errors,
                      reward_timeouts=stats.timeouts, truncated=truncated, reward_failure=stats.last_failure,
                      routes=out.routes)


def _gather_global(part: Generation) -> Generation:
    """This generation batch as the 1-process run sees it: every rank's rows, in rank order.

    Ranks generate contiguous slices of the prompts, so the concatenation in rank order is exactly the
    1-process batch (per-sequence sampling seeds make the samples identical too).
    """
    parts = D.all_gather_object(part)
    return part if len(parts) == 1 else Generation.concat(parts)


def _rank_share(kept: Generation) -> Generation:
    """This rank's contiguous share of the kept groups (whole groups stay on one rank).

    Under N processes the kept groups are trimmed to a multiple of N so that every rank trains on the
    same number of rows (FSDP collectives need equal work). A full batch (``data.batch_size`` groups, a
    multiple of N) is never trimmed; only a step that ran out of generation batches with
    ``on_exhausted: train`` can lose up to N - 1 groups.
    """
    world = D.get_world_size()
    if world == 1:
        return kept
    groups = list(dict.fromkeys(kept.group_ids))
    groups = groups[: len(groups) - len(groups) % world]
    mine = set(groups[D.rank_slice(len(groups))])
    return kept.select([i for i, g in enumerate(kept.group_ids) if g in mine])


def sample_experience(cfg: RunConfig, ro: Rollout) -> Experience:
    """Generate on this rank's slice of the prompts, then decide over the global batch (identically on every
    rank) which groups to keep, and return this rank's share of them (no model-side views yet)."""
    ds = cfg.algorithm.dynamic_sampling
    target = cfg.data.batch_size  # groups (prompts) in the global batch
    kept: list[Generation] = []
    counts = RolloutCounts()
    seen: list[Generation] = []  # every generated sequence (global), for the reward/length metrics
    t0 = time.perf_counter()
    while True:
        examples = D.shard_for_rank(ro.task.sample(target, ro.task_rng))
        part = _gather_global(_generate_and_score(cfg, ro, examples, first_row=D.rank_slice(target).start * cfg.rollout.n))
        seen.append(part)
        counts.gen_batches += 1
        _count_reward_failures(cfg, ro, part)
        rows = list(range(part.size))
        if not ds.enable:
            kept.append(part)
            counts.groups_kept = target
            break
        metric = part.raw >= 1.0 if ds.metric == "acc" else part.shaped
        keep = A.filter_groups(metric.float(), part.group_ids).tolist()
        groups = list(dict.fromkeys(part.group_ids))
        keep_groups = [g for g in groups if keep[part.group_ids.index(g)]]
        counts.groups_filtered += len(groups) - len(keep_groups)
        keep_groups = keep_groups[: target - counts.groups_kept]  # only what the batch still needs, in arrival order
        chosen = set(keep_groups)
        kept.append(part.select([i for i in rows if part.group_ids[i] in chosen]))
        counts.groups_kept += len(keep_groups)
        if counts.groups_kept >= target:
            break
        if 0 < ds.max_num_gen_batches <= counts.gen_batches:
            if ds.on_exhausted == "error":
                raise TrainingAborted(
                    f"dynamic sampling kept {counts.groups_kept} of the {target} groups needed after "
                    f"{counts.gen_batches} generation batches (algorithm.dynamic_sampling.max_num_gen_batches="
                    f"{ds.max_num_gen_batches}; {counts.groups_filtered} groups had the same {ds.metric} for every "
                    "sample). Raise the bound, lower data.batch_size, or use easier/harder data."
                )
            break
    rollout_s = time.perf_counter() - t0
    everything = Generation.concat(seen)
    counts.overlong_penalized = int((everything.penalty < 0).sum())
    counts.reward_errors, counts.reward_timeouts = everything.reward_errors, everything.reward_timeouts
    counts.truncated_prompts = everything.truncated
    metrics = _rollout_metrics(everything, counts, rollout_s)
    mine = _rank_share(Generation.concat(kept))
    if not mine.size:
        return Experience(None, torch.zeros(0, device=ro.device), counts, metrics)
    batch = SequenceBatch.from_rollout(mine.prompts, mine.responses, mine.logprobs, mine.group_ids, device=ro.device,
                                       routes=mine.routes)
    return Experience(batch, mine.shaped.to(ro.device), counts, metrics)


def _count_reward_failures(cfg: RunConfig, ro: Rollout, part: Generation) -> None:
    """The stop rule of ``data.reward_max_failures_in_row``: a generation batch (the global one, so every rank
    decides alike) whose every reward failed counts, any success resets; too many in a row stop the run."""
    failed = part.reward_errors + part.reward_timeouts
    ro.reward_failures_in_row = ro.reward_failures_in_row + 1 if part.size and failed >= part.size else 0
    limit = cfg.data.reward_max_failures_in_row
    if 0 < limit <= ro.reward_failures_in_row:
        raise RewardsFailing(ro.reward_failures_in_row, "data.reward_max_failures_in_row", part.reward_failure)


def _rollout_metrics(seen: Generation, counts: RolloutCounts, rollout_s: float) -> RolloutMetrics:
    """Metrics of every generated sample (before dynamic sampling) and of the step's counts."""
    clipped = sum(f == "length" for f in seen.finish)
    return RolloutMetrics(
        reward_mean=float(seen.raw.mean()), reward_max=float(seen.raw.max()), reward_min=float(seen.raw.min()),
        reward_shaped_mean=float(seen.shaped.mean()), reward_errors=counts.reward_errors,
        reward_timeouts=counts.reward_timeouts, response_length_mean=float(seen.lengths.mean()),
        response_length_max=float(seen.lengths.max()), response_clip_ratio=clipped / seen.size,
        dapo_overlong_penalized=counts.overlong_penalized, dapo_overlong_penalty_mean=float(seen.penalty.mean()),
        prompt_truncated=counts.truncated_prompts, dapo_gen_batches=counts.gen_batches,
        dapo_groups_filtered=counts.groups_filtered, dapo_groups_kept=counts.groups_kept, time_rollout_s=rollout_s,
    )


def sampling_params(cfg: RunConfig, eos_id: int | None) -> SamplingParams:
    stops = set(cfg.rollout.stop_token_ids)
    if eos_id is not None:
        stops.add(int(eos_id))
    return SamplingParams(
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        max_tokens=cfg.rollout.max_response_length, stop_token_ids=tuple(sorted(stops)),
        micro_batch_size=cfg.rollout.micro_batch_size,
    )
