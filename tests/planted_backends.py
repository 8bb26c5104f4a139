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


# --- decode attention: backends whose decode slot proves the hf engine routes through Backend.decode_attention ----

DECODE_CALLS: list[tuple[int, ...]] = []  # q's shape of every call of counting_decode_attention


def counting_decode_attention(q, k_cache, v_cache, *, key_padding_mask, scale, window, sinks):
    """The core reference, counted: a backend naming it computes exactly what the cpu backend does."""
    from polyrl.core.attention.reference import reference_decode_attention

    DECODE_CALLS.append(tuple(q.shape))
    return reference_decode_attention(q, k_cache, v_cache, key_padding_mask=key_padding_mask, scale=scale,
                                      window=window, sinks=sinks)


def refusing_decode_attention(q, k_cache, v_cache, **kwargs):
    raise RuntimeError("planted: the decode slot ran")


class CountingDecodeBackend(CpuBackend):
    """The reference decode kernel through a slot of its own that counts its calls."""

    name = "counting_decode"
    is_reference = False
    decode_attention_kernel = "planted_backends:counting_decode_attention"


class RefusingDecodeBackend(CpuBackend):
    """A decode slot that raises: any generation that reaches it fails with "planted: the decode slot ran"."""

    name = "refusing_decode"
    is_reference = False
    decode_attention_kernel = "planted_backends:refusing_decode_attention"
