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


class RowUniforms:
    """The uniforms of ``next_uniforms`` called once per token, drawn ``block`` tokens at a time: one draw of n
    values from a CPU generator gives the n values of n single draws, in order (torch's CPU uniform kernel is
    serial; tests/rollout/test_sampling_uniforms.py holds it to that), so token t of row i gets the same uniform
    with a B-th of the host calls. ``at(t)`` for t = 0, 1, 2, ... in order; ``total``: tokens at most (no
    block reaches past it)."""

    def __init__(self, seeds: list[int], device: torch.device | str, total: int, block: int = 64) -> None:
        self.gens = row_generators(seeds)
        self.device, self.total, self.block = device, int(total), int(block)
        self.start, self.table = 0, torch.empty(len(seeds), 0)

    def at(self, t: int) -> torch.Tensor:
        """float32 [B] on the device: token t's uniform of every row."""
        if t < self.start or t > self.start + self.table.shape[1]:
            raise ValueError(f"RowUniforms.at({t}): tokens are taken in order (next is {self.start + self.table.shape[1]})")
        if t == self.start + self.table.shape[1]:  # the next block of every row's stream
            self.start, n = t, max(1, min(self.block, self.total - t))
            block = torch.stack([torch.rand(n, generator=g) for g in self.gens]) if self.gens else torch.empty(0, n)
            self.table = block.to(self.device, non_blocking=True)
        return self.table[:, t - self.start]


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] for the uniforms ``u`` [B]: the first token whose cumulative
    probability exceeds ``u`` (``right=True`` never lands on a zero-probability token)."""
    cdf = probs.cumsum(-1)
    nxt = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return nxt.clamp(max=probs.shape[-1] - 1)
