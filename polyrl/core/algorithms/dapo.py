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
