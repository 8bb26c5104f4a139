"""Rollout correction: importance weights and masks between the engine's sampling policy μ and the trainer's π_old.

An engine with its own weights and kernels (vLLM) samples from μ, which is never exactly the trainer's π_old
(another precision, attention, MoE and sampler implementation). The PPO ratio π/π_old corrects the update's
staleness but not this mismatch; these functions compute what does, from the log-probs of the same tokens
(docs/algorithms.md, "Rollout correction", has the formulas and the mapping to verl's and slime's knobs):

- ``log_ratio``: δ_t = log π_old − log μ on the valid tokens (0 on padding, whatever padding holds);
- ``is_weights``: the raw weight ρ at the token / sequence (product) / geometric-mean level, and the applied
  weight w = min(ρ, cap) (truncated IS), detached, 0 on padding;
- ``keep_mask``: the tokens the update keeps: inside the IcePop band on the token ratio, and in a sequence not
  rejected by its worst token or its geometric-mean ratio.

Pure tensor functions over one rank's ``[B, R]`` rows; every statistic here is per row, so the result does not
depend on how the batch is split over ranks (the metrics' global reductions are the trainer's).
"""

from __future__ import annotations

import torch

from polyrl.core.algorithms.losses import LOG_RATIO_CLAMP

IS_LEVELS = ("token", "sequence", "geometric")
REJECT_MODES = ("max_token", "geometric")


def log_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """δ = log π_old − log μ per token ([B, R], fp32 or wider), 0 where ``mask`` is 0 (padding may hold anything)."""
    dtype = torch.promote_types(old_logp.dtype, torch.float32)
    diff = old_logp.detach().to(dtype) - rollout_logp.detach().to(dtype)
    return torch.where(mask.bool(), diff, torch.zeros_like(diff))


def _row_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask.to(x.dtype)).sum(-1)  # [B]


def _row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _row_sum(x, mask) / mask.to(x.dtype).sum(-1).clamp(min=1)  # [B]; 0 for a row without tokens


def raw_weights(delta: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """ρ per token ([B, R], 0 on padding) at ``level``: token ρ_t = exp(δ_t); sequence ρ_i = exp(Σ_t δ_t), the
    product of its token ratios; geometric ρ_i = exp(mean_t δ_t). The exponent is clamped to ±20 first (as the
    PPO ratio: finite in fp32)."""
    if level == "token":
        log_w = delta
    elif level == "sequence":
        log_w = _row_sum(delta, mask).unsqueeze(-1).expand_as(delta)
    elif level == "geometric":
        log_w = _row_mean(delta, mask).unsqueeze(-1).expand_as(delta)
    else:
        raise ValueError(f"rollout correction level must be one of {IS_LEVELS}, got {level!r}")
    rho = torch.exp(torch.clamp(log_w, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return rho * mask.to(rho.dtype)


def is_weights(delta: torch.Tensor, mask: torch.Tensor, level: str, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ρ, w): the raw weights at ``level`` and the truncated ones w = min(ρ, cap) ([B, R], 0 on padding)."""
    if not cap > 0:
        raise ValueError(f"rollout correction cap must be > 0, got {cap}")
    rho = raw_weights(delta, mask, level)
    return rho, torch.clamp(rho, max=cap)


def keep_mask(delta: torch.Tensor, mask: torch.Tensor, *, token_band: tuple[float, float] | None = None,
              reject: str | None = None, reject_band: tuple[float, float] | None = None) -> torch.Tensor:
    """The tokens the update keeps ([B, R], 0/1 in ``delta``'s dtype, 0 on padding).

    ``token_band`` (low, high): IcePop, a token is kept when low ≤ r_t ≤ high (r_t = exp(δ_t)).
    ``reject`` with ``reject_band`` (low, high) drops whole sequences: ``max_token`` when any of its tokens has
    r_t outside the band (its worst token decides), ``geometric`` when exp(mean_t δ_t) is outside the band. The
    comparisons are made on log(r) against log(low) / log(high) (no exp, so no overflow)."""
    valid = mask.bool()
    keep = valid.clone()
    if token_band is not None:
        lo, hi = (float(torch.log(torch.tensor(b, dtype=torch.float64))) for b in token_band)
        keep &= (delta >= lo) & (delta <= hi)
    if reject is not None:
        if reject_band is None:
            raise ValueError("sequence rejection needs its band (low, high)")
        lo, hi = (float(torch.log(torch.tensor(b, dtype=torch.float64))) for b in reject_band)
        if reject == "max_token":
            outside = valid & ((delta < lo) | (delta > hi))
            seq_ok = ~outside.any(-1)
        elif reject == "geometric":
            g = _row_mean(delta, mask)
            seq_ok = (g >= lo) & (g <= hi)
        else:
            raise ValueError(f"sequence rejection must be one of {REJECT_MODES}, got {reject!r}")
        keep &= seq_ok.unsqueeze(-1)
    return keep.to(delta.dtype)


def k1_k3(delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token estimators of KL(μ ‖ π_old) on tokens sampled from μ ([B, R], 0 on padding):
    k1 = log μ − log π_old = −δ, k3 = r − 1 − log r with r = exp(δ) (≥ 0; δ clamped to ±20 before the exp)."""
    m = mask.to(delta.dtype)
    d = torch.clamp(delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return -delta * m, (torch.exp(d) - 1.0 - d) * m
