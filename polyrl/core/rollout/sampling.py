"""Sampling randomness that is the same on every device: per-sequence CPU generators, uniforms drawn on the host.

Token ``t`` of sequence ``i`` is picked by inverse CDF with the ``t``-th uniform of the sequence's own generator,
seeded from the sequence's seed (``row_seeds``). Why this shape:

- per sequence: a sequence's tokens depend neither on which sequences share its batch nor on its rank, so an
  N-process run samples what the 1-process run samples;
- CPU generators, uniforms copied to the device once per decode step: every backend (CPU, GPU, NPU) sees the
  same uniforms bit for bit — a device generator would give each device family its own stream, and its state
  could not be restored on another backend;
- the host draws B scalars per decode step (microseconds each) and the device gets one copy: no device-side
  generator launches, no host sync.
"""

from __future__ import annotations

import torch


def row_generators(seeds: list[int]) -> list[torch.Generator]:
    """One CPU generator per sequence, seeded with its sampling seed."""
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


def next_uniforms(gens: list[torch.Generator], device: torch.device | str) -> torch.Tensor:
    """float32 [B]: the next uniform of each sequence's generator, on ``device`` (one host-to-device copy)."""
    u = torch.stack([torch.rand((), generator=g) for g in gens])
    return u.to(device, non_blocking=True)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] for the uniforms ``u`` [B]: the first token whose cumulative
    probability exceeds ``u`` (``right=True`` never lands on a zero-probability token)."""
    cdf = probs.cumsum(-1)
    nxt = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return nxt.clamp(max=probs.shape[-1] - 1)
