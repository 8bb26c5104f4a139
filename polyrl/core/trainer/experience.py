"""From prompts to a scored training batch: rollout → reward → overlong shaping → DAPO dynamic sampling.

``collect_experience`` draws ``data.batch_size`` prompts (this rank takes its contiguous slice), samples
``rollout.n`` responses each, scores them with the task (a reward that raises or times out scores as
failure and is counted), adds the DAPO overlong penalty, and — with dynamic sampling on — keeps only groups
whose metric varies, drawing new generation batches until enough groups are kept or
``max_num_gen_batches`` is reached (then "error" stops the run with DAPO's message, "train" trains on
what was kept).
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
from polyrl.core.rollout import SamplingParams
from polyrl.core.trainer.batch import SequenceBatch


class TrainingAborted(RuntimeError):
    """The run cannot continue (non-finite updates in a row, dynamic sampling exhausted); message says why."""


@dataclasses.dataclass
class Rollout:
    """What generation needs, built once by the trainer: the task (prompts and scores), the tokenizer, the
    engine and its sampling parameters, the CPU generator of per-sequence sampling seeds, and the device the
    training batch is built on (``Backend.device``)."""

    task: Any
    tokenizer: Any
    engine: Any
    sampling: SamplingParams
    sample_gen: torch.Generator
    task_rng: Any  # random.Random of the prompt stream
    device: torch.device


@dataclasses.dataclass
class Experience:
    batch: SequenceBatch | None  # None when dynamic sampling kept nothing
    scores: torch.Tensor  # [B] shaped sequence scores (task score + overlong penalty), on the batch's device
    metrics: dict[str, float]
    # counters of this step, as values (the trainer accumulates them into TrainerState.counters)
    gen_batches: int = 0
    groups_filtered: int = 0
    overlong_penalized: int = 0
    reward_errors: int = 0
    reward_timeouts: int = 0




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


def _generate_and_score(cfg: RunConfig, ro: Rollout, examples: list, first_row: int = 0) -> dict[str, Any]:
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
    out = ro.engine.generate(seq_prompts, ro.sampling, row_seeds=seeds)
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
    return {
        "prompts": seq_prompts, "responses": out.response_ids, "logprobs": out.logprobs,
        "group_ids": [ex.group_id for ex in seq_examples], "raw": raw_t, "shaped": raw_t + penalty,
        "penalty": penalty, "lengths": lengths, "finish": out.finish_reasons, "stats": stats,
        "truncated": truncated,
    }


_ROW_KEYS = ("prompts", "responses", "logprobs", "group_ids", "finish")  # per-sequence lists of a part
_TENSOR_KEYS = ("raw", "shaped", "penalty", "lengths")


def _gather_global(part: dict[str, Any]) -> dict[str, Any]:
    """This generation batch as the 1-process run sees it: every rank's rows, in rank order.

    Ranks generate contiguous slices of the prompts, so the concatenation in rank order is exactly the
    1-process batch (per-sequence sampling seeds make the samples identical too).
    """
    parts = D.all_gather_object(part)
    if len(parts) == 1:
        return part
    out: dict[str, Any] = {k: [x for p in parts for x in p[k]] for k in _ROW_KEYS}
    out.update({k: torch.cat([p[k] for p in parts]) for k in _TENSOR_KEYS})
    out["stats"] = {k: sum(p["stats"].get(k, 0) for p in parts) for k in parts[0]["stats"]}
    out["truncated"] = sum(p["truncated"] for p in parts)
    return out


_SEQ_KEYS = ("prompts", "responses", "logprobs", "group_ids")  # what a training batch is built from


def _select(part: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """The sequences ``rows`` of ``part`` (lists per key, plus their shaped scores)."""
    out = {k: [part[k][i] for i in rows] for k in _SEQ_KEYS}
    out["shaped"] = part["shaped"][rows]
    return out


def _rank_share(kept: list[dict[str, Any]]) -> dict[str, Any]:
    """This rank's contiguous share of the kept groups (whole groups stay on one rank).

    Under N processes the kept groups are trimmed to a multiple of N so that every rank trains on the
    same number of rows (FSDP collectives need equal work). A full batch (``data.batch_size`` groups, a
    multiple of N) is never trimmed; only a step that ran out of generation batches with
    ``on_exhausted: train`` can lose up to N - 1 groups.
    """
    rows = {k: [x for part in kept for x in part[k]] for k in _SEQ_KEYS}
    rows["shaped"] = torch.cat([part["shaped"] for part in kept]) if kept else torch.zeros(0)
    world = D.get_world_size()
    if world == 1:
        return rows
    groups = list(dict.fromkeys(rows["group_ids"]))
    groups = groups[: len(groups) - len(groups) % world]
    mine = set(groups[D.rank_slice(len(groups))])
    return _select(rows, [i for i, g in enumerate(rows["group_ids"]) if g in mine])


def collect_experience(cfg: RunConfig, ro: Rollout) -> Experience:
    """Generate on this rank's slice of the prompts, then decide over the global batch (identically on every
    rank) which groups to keep, and train on this rank's share of them."""
    ds = cfg.algorithm.dynamic_sampling
    target = cfg.data.batch_size  # groups (prompts) in the global batch
    kept: list[dict[str, Any]] = []
    kept_groups = gen_batches = filtered_groups = 0
    seen: list[dict[str, Any]] = []  # every generated sequence (global), for the reward/length metrics
    t0 = time.perf_counter()
    while True:
        examples = D.shard_for_rank(ro.task.sample(target, ro.task_rng))
        part = _generate_and_score(cfg, ro, examples, first_row=D.rank_slice(target).start * cfg.rollout.n)
        part = _gather_global(part)
        seen.append(part)
        gen_batches += 1
        rows = list(range(len(part["prompts"])))
        if not ds.enable:
            kept.append(_select(part, rows))
            kept_groups = target
            break
        metric = part["raw"] >= 1.0 if ds.metric == "acc" else part["shaped"]
        keep = A.filter_groups(metric.float(), part["group_ids"]).tolist()
        groups = list(dict.fromkeys(part["group_ids"]))
        keep_groups = [g for g in groups if keep[part["group_ids"].index(g)]]
        filtered_groups += len(groups) - len(keep_groups)
        keep_groups = keep_groups[: target - kept_groups]  # only what the batch still needs, in arrival order
        chosen = set(keep_groups)
        kept.append(_select(part, [i for i in rows if part["group_ids"][i] in chosen]))
        kept_groups += len(keep_groups)
        if kept_groups >= target:
            break
        if 0 < ds.max_num_gen_batches <= gen_batches:
            if ds.on_exhausted == "error":
                raise TrainingAborted(
                    f"dynamic sampling kept {kept_groups} of the {target} groups needed after {gen_batches} "
                    f"generation batches (algorithm.dynamic_sampling.max_num_gen_batches={ds.max_num_gen_batches}; "
                    f"{filtered_groups} groups had the same {ds.metric} for every sample). Raise the bound, lower "
                    "data.batch_size, or use easier/harder data."
                )
            break
    rollout_s = time.perf_counter() - t0

    metrics = _rollout_metrics(cfg, seen)
    metrics.update({"dapo/gen_batches": gen_batches, "dapo/groups_filtered": filtered_groups,
                    "dapo/groups_kept": kept_groups, "time/rollout_s": rollout_s})
    counts = dict(
        gen_batches=gen_batches, groups_filtered=filtered_groups,
        overlong_penalized=int(metrics["dapo/overlong_penalized"]),
        reward_errors=int(metrics["reward/errors"]), reward_timeouts=int(metrics["reward/timeouts"]),
    )
    mine = _rank_share(kept)
    if not mine["prompts"]:
        return Experience(None, torch.zeros(0, device=ro.device), metrics, **counts)
    batch = SequenceBatch.from_rollout(mine["prompts"], mine["responses"], mine["logprobs"], mine["group_ids"],
                                       device=ro.device)
    return Experience(batch, mine["shaped"].to(ro.device), metrics, **counts)


def _rollout_metrics(cfg: RunConfig, seen: list[dict[str, Any]]) -> dict[str, float]:
    raw = torch.cat([p["raw"] for p in seen])
    lengths = torch.cat([p["lengths"] for p in seen])
    penalty = torch.cat([p["penalty"] for p in seen])
    clipped = sum(f == "length" for p in seen for f in p["finish"])
    return {
        # reward/* is the task's own score (before overlong shaping), over every generated sample
        "reward/mean": float(raw.mean()),
        "reward/max": float(raw.max()),
        "reward/min": float(raw.min()),
        "reward/shaped_mean": float((raw + penalty).mean()),
        "reward/errors": sum(p["stats"].get("reward/errors", 0) for p in seen),
        "reward/timeouts": sum(p["stats"].get("reward/timeouts", 0) for p in seen),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/clip_ratio": clipped / len(lengths),
        "dapo/overlong_penalized": int((penalty < 0).sum()),
        "dapo/overlong_penalty_mean": float(penalty.mean()),
        "prompt/truncated": sum(p["truncated"] for p in seen),
    }


def sampling_params(cfg: RunConfig, eos_id: int | None) -> SamplingParams:
    stops = set(cfg.rollout.stop_token_ids)
    if eos_id is not None:
        stops.add(int(eos_id))
    return SamplingParams(
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        max_tokens=cfg.rollout.max_response_length, stop_token_ids=tuple(sorted(stops)),
        micro_batch_size=cfg.rollout.micro_batch_size,
    )
