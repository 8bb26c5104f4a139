"""PPO-family losses: clipped policy loss (clip-higher, dual clip), clipped value loss, entropy.

Small pure functions: per-token loss matrix -> ``aggregate``. Every loss forwards the global counts
(``global_tokens``, ``global_seqs``, ``max_len``) so that a micro-batch returns its share of the
mini-batch loss (see aggregation.py). Metrics are detached 0-d tensors averaged over this call's valid
tokens (no host sync); the trainer averages them over micro-batches for logging.
"""

from __future__ import annotations

import torch

from polyrl.core.algorithms.aggregation import aggregate, masked_mean

# Bound on log(ratio) before exponentiating: exp(20) is ~5e8, finite in fp32, so one token with a
# stale logprob cannot produce inf/NaN.
LOG_RATIO_CLAMP = 20.0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    weights: torch.Tensor | None = None,
    agg: str = "token-mean",
    global_tokens: int | float | None = None,
    global_seqs: int | float | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss with separate low/high clip and optional dual clip.

    ratio = exp(clamp(logp − old, ±20)); pg1 = −A·ratio; pg2 = −A·clamp(ratio, 1 − clip_low, 1 + clip_high);
    L = max(pg1, pg2); for A < 0 with dual clip: L = min(−A·clip_c, L); with ``weights`` (the rollout
    correction's IS weights, detached): L ← w·L. Then ``aggregate(L, mask, agg)``.

    Args:
        logp: [B, T] current log-probs (differentiable). old_logp: [B, T] behaviour log-probs.
        advantages: [B, T]. mask: [B, T] 0/1 response mask.
        clip_low, clip_high: ε_low, ε_high (DAPO clip-higher: 0.2 / 0.28).
        clip_c: dual-clip constant c > 1 (None disables; reference PPO uses 3, DAPO 10).
        weights: [B, T] per-token weights of the loss (None: 1), e.g. truncated IS weights π_old/μ.
        agg, global_tokens, global_seqs, max_len: see ``aggregate``.
    Returns:
        (loss 0-d, metrics): pg_clipfrac (fraction where the clipped term was taken), ppo_kl
        (mean of old − logp), pg_clipfrac_lower (fraction where the dual clip bound was taken),
        clipfrac_low / clipfrac_high (fractions with A < 0 and ratio < 1 − clip_low / A > 0 and
        ratio > 1 + clip_high: which side of the clip range was hit, of this ratio, clamp included).
    """
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"dual-clip constant clip_c must be > 1, got {clip_c}")
    adv = advantages.detach().to(logp.dtype)
    log_ratio = torch.clamp(logp - old_logp.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(pg1, pg2)
    with torch.no_grad():
        clipfrac = masked_mean((pg2 > pg1).float(), mask)
        ppo_kl = masked_mean(-log_ratio.float(), mask)
        clipfrac_low = masked_mean(((adv < 0) & (ratio < 1.0 - clip_low)).float(), mask)
        clipfrac_high = masked_mean(((adv > 0) & (ratio > 1.0 + clip_high)).float(), mask)
    if clip_c is not None:
        pg3 = -adv * clip_c
        lower = torch.minimum(pg3, clipped)
        with torch.no_grad():
            clipfrac_lower = masked_mean(((clipped > pg3) & (adv < 0)).float(), mask)
        loss_mat = torch.where(adv < 0, lower, clipped)
    else:
        clipfrac_lower = torch.zeros((), device=logp.device)
        loss_mat = clipped
    if weights is not None:
        loss_mat = loss_mat * weights.detach().to(loss_mat.dtype)
    loss = aggregate(loss_mat, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs, max_len=max_len)
    metrics = {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl, "pg_clipfrac_lower": clipfrac_lower,
               "clipfrac_low": clipfrac_low, "clipfrac_high": clipfrac_high}
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.5,
    agg: str = "token-mean",
    global_tokens: int | float | None = None,
    global_seqs: int | float | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ½·agg(max((v − R)², (clamp(v, V_old − c, V_old + c) − R)²)).

    Args:
        values: [B, T] current critic predictions (differentiable). old_values: [B, T] values at rollout.
        returns: [B, T] GAE returns. mask: [B, T]. clip: c (None = unclipped (v − R)²).
        agg, global_tokens, global_seqs, max_len: see ``aggregate``.
    Returns:
        (loss 0-d, metrics): vf_clipfrac (fraction where the clipped error was larger), vpred_mean.
    """
    ret = returns.detach().to(values.dtype)
    err1 = (values - ret) ** 2
    if clip is None:
        loss_mat = err1
        clipfrac = torch.zeros((), device=values.device)
    else:
        old = old_values.detach().to(values.dtype)
        v_clipped = torch.clamp(values, old - clip, old + clip)
        err2 = (v_clipped - ret) ** 2
        loss_mat = torch.maximum(err1, err2)
        with torch.no_grad():
            clipfrac = masked_mean((err2 > err1).float(), mask)
    loss = 0.5 * aggregate(loss_mat, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs, max_len=max_len)
    with torch.no_grad():
        vpred_mean = masked_mean(values.detach().float(), mask)
    return loss, {"vf_clipfrac": clipfrac, "vpred_mean": vpred_mean}


def entropy_loss(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    global_tokens: int | float | None = None,
    global_seqs: int | float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Aggregated token entropy (a bonus: the trainer *subtracts* ``entropy_coef`` times it).

    Args: entropy [B, T] (``entropy_from_logits``); mask [B, T]; the rest as in ``aggregate``.
    """
    return aggregate(entropy, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs, max_len=max_len)
