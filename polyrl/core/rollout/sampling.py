"""Counter-based sampling: the uniform number that picks token ``t`` of a sequence is a hash of (the
sequence's seed, t), computed with integer tensor ops on whatever device holds the logits.

Why not a ``torch.Generator`` per sequence: drawing from B generators costs B kernel launches per decode step
(launch-bound on a GPU), generator state is device-specific (a CUDA generator cannot be saved into a CPU
checkpoint and restored on an NPU), and each device family has its own random stream. A hash has none of these
problems: one vectorised op per step, no state to save beyond the sequence seeds (drawn from a CPU generator
that checkpoints save), and the same uniforms bit for bit on every device, rank count and batch composition —
a sequence samples the same tokens on a CPU, a GPU or an NPU whenever their probabilities agree.

The hash is splitmix64's finaliser (Steele, Lea, Flood 2014) over ``seed + (t + 1) * golden``, in int64 with
wrapping arithmetic; the top 24 bits give a float32 uniform in [0, 1) exactly.
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _signed(v: int) -> int:
    """``v`` modulo 2**64 as a signed int64 (torch has no uint64 arithmetic on every device)."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic: clear the sign-extended bits)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on an int64 tensor (bijective, avalanching)."""
    x = x ^ _shr(x, 30)
    x = x * _signed(_M1)
    x = x ^ _shr(x, 27)
    x = x * _signed(_M2)
    return x ^ _shr(x, 31)


def uniforms(seeds: torch.Tensor, t: int) -> torch.Tensor:
    """float32 [B] in [0, 1): the uniform of token ``t`` for each sequence seed in ``seeds`` (int64 [B])."""
    h = mix64(seeds + _signed((t + 1) * _GOLDEN))
    return _shr(h, 40).to(torch.float32) * (2.0**-24)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] for the uniforms ``u`` [B]: the first token whose cumulative
    probability exceeds ``u`` (``right=True`` never lands on a zero-probability token)."""
    cdf = probs.cumsum(-1)
    nxt = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return nxt.clamp(max=probs.shape[-1] - 1)
