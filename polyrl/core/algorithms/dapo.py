"""DAPO pieces that live at the data level: overlong reward shaping and dynamic sampling.

Dynamic sampling drops prompt groups whose metric (usually accuracy) is the same for every sample: with
group-relative advantages such a group has zero advantage everywhere and contributes no gradient, only
noise in the token count. ``DynamicSampler`` accumulates generation batches until enough informative
groups are kept, and fails loudly after ``max_num_gen_batches``. It knows nothing about rollout engines:
it takes per-row group ids, metric values and an arbitrary payload (dict of tensors / lists).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def overlong_penalty(
    response_lengths: torch.Tensor | Sequence[int],
    max_response_length: int,
    buffer_length: int,
    factor: float = 1.0,
) -> torch.Tensor:
    """Soft overlong punishment: min(−(L − (L_max − buffer))/buffer · factor, 0).

    0 up to L_max − buffer, then linear down to −factor at L = L_max.

    Args:
        response_lengths: [B] valid response lengths (tokens). max_response_length: L_max.
        buffer_length: the punishment ramp (DAPO: 4096 for L_max 20480). factor: penalty at L_max.
    Returns:
        [B] fp32 penalties (<= 0), to add to the sequence rewards.
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(f"buffer_length must be in (0, {max_response_length}], got {buffer_length}")
    lengths = torch.as_tensor(response_lengths).float()
    exceed = lengths - (max_response_length - buffer_length)
    return torch.clamp(-exceed / buffer_length * factor, max=0.0)


def _ids_list(group_ids: Any) -> list[Any]:
    return group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)


def filter_groups(metric_values: Any, group_ids: Any, *, keep_singletons: bool = True) -> torch.Tensor:
    """Keep mask of DAPO dynamic sampling: a row is kept when its group's metric varies.

    "Varies" means population std > 0, tested exactly as max > min (immune to rounding of identical
    floats). A group of one has std 0 but is kept by default, as in verl (``keep_singletons``).

    Args: metric_values: [B] numbers (tensor or sequence). group_ids: B ids. Returns: [B] bool.
    """
    vals = torch.as_tensor(metric_values, dtype=torch.float64).flatten().tolist()
    ids = _ids_list(group_ids)
    if len(ids) != len(vals):
        raise ValueError(f"{len(vals)} metric values for {len(ids)} group ids")
    lo: dict[Any, float] = {}
    hi: dict[Any, float] = {}
    size: dict[Any, int] = {}
    for g, v in zip(ids, vals, strict=True):
        lo[g] = min(lo.get(g, v), v)
        hi[g] = max(hi.get(g, v), v)
        size[g] = size.get(g, 0) + 1
    keep_group = {g: hi[g] > lo[g] or (keep_singletons and size[g] == 1) for g in size}
    return torch.tensor([keep_group[g] for g in ids], dtype=torch.bool)


class DynamicSamplingExhausted(RuntimeError):
    """Raised when ``max_num_gen_batches`` generation batches did not yield enough varied groups."""


def _select_rows(payload: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in payload.items():
        if isinstance(value, torch.Tensor):
            out[key] = value[torch.as_tensor(rows, dtype=torch.long, device=value.device)]
        else:
            seq = list(value)
            out[key] = [seq[i] for i in rows]
    return out


class DynamicSampler:
    """Accumulate generation batches until ``target_groups`` varied groups are kept (DAPO).

    Usage::

        sampler = DynamicSampler(target_groups=512, max_num_gen_batches=10)
        while not sampler.is_full:
            rows = generate_and_score()                        # the trainer's business
            sampler.add(rows["uid"], rows["acc"], rows)        # raises DynamicSamplingExhausted
        batch = sampler.result()                               # exactly 512 groups, arrival order

    Args:
        target_groups: groups (prompts) the training batch needs.
        max_num_gen_batches: generation batches allowed before failing; <= 0 means unlimited.
        keep_singletons: see ``filter_groups``.
    """

    def __init__(self, target_groups: int, max_num_gen_batches: int, *, keep_singletons: bool = True) -> None:
        if target_groups <= 0:
            raise ValueError(f"target_groups must be > 0, got {target_groups}")
        self.target_groups = int(target_groups)
        self.max_num_gen_batches = int(max_num_gen_batches)
        self.keep_singletons = keep_singletons
        self.reset()

    def reset(self) -> None:
        """Start a new training batch (counts and stored rows are cleared)."""
        self.num_gen_batches = 0
        self.kept_groups = 0
        self.filtered_groups = 0
        self.kept_rows = 0
        self.filtered_rows = 0
        self._parts: list[tuple[list[Any], dict[str, Any]]] = []  # (group id per kept row, kept payload)

    @property
    def is_full(self) -> bool:
        return self.kept_groups >= self.target_groups

    def add(self, group_ids: Any, metric_values: Any, payload: dict[str, Any]) -> dict[str, Any]:
        """Filter one generation batch and keep its varied groups.

        Args:
            group_ids: [B] ids (groups are local to this batch). metric_values: [B].
            payload: dict of [B, ...] tensors or length-B lists; rows are selected from every entry.
        Returns:
            the kept rows of this batch (same keys as payload).
        Raises:
            DynamicSamplingExhausted: when, after this batch, the sampler is still not full and
                ``max_num_gen_batches`` (> 0) batches have been generated.
        """
        ids = _ids_list(group_ids)
        for key, value in payload.items():
            if len(value) != len(ids):
                raise ValueError(f"payload[{key!r}] has {len(value)} rows for {len(ids)} group ids")
        keep = filter_groups(metric_values, ids, keep_singletons=self.keep_singletons).tolist()
        rows = [i for i, k in enumerate(keep) if k]
        n_kept = len({ids[i] for i in rows})
        n_groups = len(set(ids))
        self.num_gen_batches += 1
        self.kept_groups += n_kept
        self.filtered_groups += n_groups - n_kept
        self.kept_rows += len(rows)
        self.filtered_rows += len(ids) - len(rows)
        kept = _select_rows(payload, rows)
        self._parts.append(([ids[i] for i in rows], kept))
        if not self.is_full and 0 < self.max_num_gen_batches <= self.num_gen_batches:
            raise DynamicSamplingExhausted(
                f"dynamic sampling kept {self.kept_groups} of the {self.target_groups} groups needed after "
                f"{self.num_gen_batches} generation batches (max_num_gen_batches={self.max_num_gen_batches}; "
                f"{self.filtered_groups} groups filtered because every sample had the same metric). The data "
                "may be too easy or too hard for the policy: raise max_num_gen_batches (<= 0 = unlimited), "
                "lower the batch size, or change the data."
            )
        return kept

    def result(self) -> dict[str, Any]:
        """The first ``target_groups`` kept groups in arrival order, concatenated across batches.

        Tensors are concatenated along dim 0 (their trailing shapes must agree: pad first); lists are
        joined. Raises RuntimeError when not full.
        """
        if not self.is_full:
            raise RuntimeError(f"DynamicSampler not full: {self.kept_groups}/{self.target_groups} groups")
        taken = 0
        pieces: list[dict[str, Any]] = []
        for ids, part in self._parts:
            rows: list[int] = []
            seen: set[Any] = set()
            for i, g in enumerate(ids):
                if g not in seen:
                    if taken + len(seen) >= self.target_groups:
                        continue
                    seen.add(g)
                rows.append(i)
            taken += len(seen)
            pieces.append(_select_rows(part, rows))
            if taken >= self.target_groups:
                break
        out: dict[str, Any] = {}
        for key in pieces[0]:
            values = [p[key] for p in pieces]
            if isinstance(values[0], torch.Tensor):
                shapes = {tuple(v.shape[1:]) for v in values}
                if len(shapes) > 1:
                    raise ValueError(f"payload[{key!r}] trailing shapes differ across batches: {shapes}")
                out[key] = torch.cat(values, dim=0)
            else:
                out[key] = [x for v in values for x in v]
        return out

    def metrics(self) -> dict[str, int]:
        """Counts for logging: generation batches used, kept/filtered groups and rows."""
        return {
            "num_gen_batches": self.num_gen_batches,
            "kept_groups": self.kept_groups,
            "filtered_groups": self.filtered_groups,
            "kept_rows": self.kept_rows,
            "filtered_rows": self.filtered_rows,
        }
