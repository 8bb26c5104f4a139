"""Advantage estimators: GAE (PPO with a critic) and group-relative outcome advantages (GRPO/DAPO).

Semantics follow verl so that numbers carry over:
- GAE runs right to left with a *masked carry*: at a masked position the next value and the running
  advantage pass through unchanged, so padding or tool-output tokens inside a response do not break the
  recursion. Advantages are then whitened over the mask with the unbiased variance.
- GRPO scores a sequence by the sum of its token rewards, normalises within its group by the mean and the
  unbiased (N-1) std; a group of one gets mean 0 and std 1 (its advantage is its score / (1 + eps)).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from polyrl.core.algorithms.aggregation import masked_mean, masked_sum


def sequence_scores(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Outcome score of each sequence: the sum of its token rewards over the mask.

    Args: token_rewards [B, T]; mask [B, T] 0/1. Returns: [B] in token_rewards' dtype.
    """
    return masked_sum(token_rewards, mask, dim=-1)


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Copy a per-sequence value onto every valid token of its row (0 on masked tokens).

    Args: seq_values [B]; mask [B, T]. Returns: [B, T] in seq_values' dtype.
    """
    return seq_values.unsqueeze(-1) * mask.to(seq_values.dtype)


def last_token_rewards(seq_scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score on the last valid token of its row (the PPO reward layout).

    Rows without a valid token get all zeros. Args: seq_scores [B]; mask [B, T]. Returns: [B, T].
    """
    B, T = mask.shape
    valid = mask.bool()
    positions = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(-1)  # [B]
    out = torch.zeros(B, T, dtype=seq_scores.dtype, device=seq_scores.device)
    has = last >= 0
    out[has, last[has]] = seq_scores[has]
    return out


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, *,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """(v − mean) · rsqrt(var + eps) over the valid entries, var with Bessel's n/(n−1) correction.

    With a single valid entry the variance is taken as 0. Masked entries of the result are 0.
    ``reduce_sum``: when the valid entries are spread over several processes, a function that sums a tensor
    over them (an all-reduce); the statistics are then the global batch's: sum, sum of squares and count are
    reduced in fp64 and the variance is E[v²] − mean² (one pass, so one reduction). Those three fp64 sums are
    taken on the host (an NPU computes fp64 slowly; a CPU run's numbers are unchanged).
    Args: values [B, T]; mask [B, T]. Returns: [B, T].
    """
    if reduce_sum is not None:
        m = mask.detach().cpu().to(torch.float64)
        v = values.detach().cpu().to(torch.float64) * m
        total, total_sq, n = reduce_sum(torch.stack([v.sum(), (v * v).sum(), m.sum()])).tolist()
        mean = total / max(n, 1.0)
        var = max(total_sq / max(n, 1.0) - mean * mean, 0.0) * (n / (n - 1) if n > 1 else 1.0)
        return ((values.float() - mean) * (var + eps) ** -0.5) * mask.to(values.dtype)
    n = mask.to(values.dtype).sum()
    mean = masked_mean(values, mask)
    centered = values - mean
    var = masked_mean(centered * centered, mask)
    if n > 1:
        var = var * (n / (n - 1))
    out = centered * torch.rsqrt(var + eps)
    return torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device))


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    *,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation with a masked carry.

    Right to left: δ_t = r_t + γ·V_next − V_t;  A_t = δ_t + γλ·A_next; at a masked t, V_next and A_next
    are carried through unchanged (and the position's own A is the carried value). Returns = A + V
    (before whitening). Beyond the last token V_next = A_next = 0.

    Args:
        token_rewards: [B, T] (KL-penalised) rewards; values: [B, T] old critic values; mask: [B, T] 0/1.
        gamma, lam: discount and GAE lambda (reference PPO: 1.0, 1.0).
        whiten: whiten the advantages over the mask (unbiased variance, eps 1e-8).
    Returns:
        (advantages [B, T], returns [B, T]) in fp32; advantages are zero on masked tokens when whitened.
    """
    rewards = token_rewards.float()
    vals = values.float()
    m = mask.float()
    B, T = rewards.shape
    next_value = torch.zeros(B, dtype=torch.float32, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    adv = torch.empty_like(rewards)
    for t in range(T - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        a_t = delta + gamma * lam * next_adv
        mt = m[:, t]
        next_value = vals[:, t] * mt + (1.0 - mt) * next_value
        next_adv = a_t * mt + (1.0 - mt) * next_adv
        adv[:, t] = next_adv
    returns = adv + vals
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns


def _group_index(group_ids: Any, n: int) -> tuple[torch.Tensor, int]:
    """Map arbitrary per-row ids (ints, strings, a tensor) to dense group indices 0..G-1."""
    if isinstance(group_ids, torch.Tensor):
        ids: Sequence[Any] = group_ids.tolist()
    else:
        ids = list(group_ids)
    if len(ids) != n:
        raise ValueError(f"group_ids has {len(ids)} entries for {n} rows")
    index: dict[Any, int] = {}
    dense = [index.setdefault(g, len(index)) for g in ids]
    return torch.tensor(dense, dtype=torch.long), len(index)


def group_stats(scores: torch.Tensor, group_ids: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group mean, unbiased std and group size (singleton groups: mean 0, std 1).

    Args: scores [B]; group_ids: B ids. Returns: (mean [B], std [B], size [B]) in fp32.
    """
    s = scores.detach().float()
    idx, G = _group_index(group_ids, s.shape[0])
    idx = idx.to(s.device)
    count = torch.zeros(G, dtype=torch.float32, device=s.device).index_add_(0, idx, torch.ones_like(s))
    mean = torch.zeros(G, dtype=torch.float32, device=s.device).index_add_(0, idx, s) / count
    centered = s - mean[idx]
    sq = torch.zeros(G, dtype=torch.float32, device=s.device).index_add_(0, idx, centered * centered)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[idx], std[idx], count[idx]


def group_advantages(
    scores: torch.Tensor, group_ids: Any, *, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantage per sequence: (s − mean_g) / (std_g + eps), or s − mean_g.

    Args:
        scores: [B] sequence scores (``sequence_scores``). group_ids: B ids (ints, strings, tensor);
            rows with the same id were sampled from the same prompt.
        norm_by_std: divide by the group's unbiased std (False = Dr.GRPO). eps: added to the std.
    Returns:
        [B] fp32 advantages; broadcast them with ``broadcast_to_tokens``.
    """
    mean, std, _ = group_stats(scores, group_ids)
    adv = scores.detach().float() - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return adv
