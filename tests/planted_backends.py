"""Backends with a planted bug, for tests that must show a check can fail (shared by the parity tests)."""

from __future__ import annotations

from polyrl.backends.cpu import CpuBackend


class WrongScaleBackend(CpuBackend):
    """Applies the softmax scale to the sinks too — a plausible kernel bug, invisible without sinks."""

    name = "wrong_scale"
    is_reference = False

    def varlen_attention(self, q, k, v, cu_seqlens, *, scale, window, sinks):
        return super().varlen_attention(q, k, v, cu_seqlens, scale=scale, window=window,
                                        sinks=None if sinks is None else sinks * scale)
