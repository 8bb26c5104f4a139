"""The attention op of polyrl: packed causal attention with sliding window, sinks and GQA.

Two forms share one semantics (docs/background.md §1-2):

- :func:`varlen_attention` — training: packed documents, no padding, one query per key. It validates its
  inputs once here and dispatches to the given backend (a model's attention passes the backend bound to it
  at construction, :mod:`polyrl.core.attention.hf`) or, for a direct call naming none, the selection rule's
  default (``polyrl.core.plugins.selection.default_backend``, resolved once per process); the backend's
  ``varlen_attention`` is a native kernel or the exact reference of :mod:`polyrl.core.attention.reference`.
- :func:`decode_attention` — generation: a batch of queries sitting at the END of a KV cache
  (q_len <= k_len, bottom-right aligned) with a key padding mask (left padding). Validated here and
  dispatched the same way to the backend's ``decode_attention`` (its ``decode_attention_kernel`` slot): the
  dense fp32 reference of :mod:`polyrl.core.attention.reference` unless the backend ships a decoding kernel
  (the cuda backend's Triton kernel, forward only).

Window ``W``: a query sees the W most recent keys of its document, itself included (``q - k < W``).
Sinks: one unscaled logit per query head joining the softmax denominator only.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from polyrl.core.attention.reference import DECODE_QUERY_CHUNK  # noqa: F401  (its former home; kept importable)

if TYPE_CHECKING:
    from polyrl.core.plugins.backend import Backend


def _check_common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window, sinks, *, ndim: int) -> None:
    names = {"q": q, "k": k, "v": v}
    for name, x in names.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    hq, d = q.shape[-2], q.shape[-1]
    hkv = k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"q and k head dims differ: {d} vs {k.shape[-1]}")
    if v.shape[-2] != hkv:
        raise ValueError(f"k and v head counts differ: {hkv} vs {v.shape[-2]}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or an int >= 1 (keys seen, query included), got {window!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
            raise ValueError("sinks must be None or a floating point tensor of shape [Hq]")
        if tuple(sinks.shape) != (hq,):
            raise ValueError(f"sinks must have shape [Hq] = [{hq}], got {tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")


def _check_cu_seqlens(cu_seqlens: torch.Tensor, t: int) -> None:
    """Shape and dtype always (free); the values only while ``cu_seqlens`` is on the host, where reading them
    costs nothing. Reading a device tensor's values would stall the host once per attention call (every layer
    of every forward), so a device-resident ``cu_seqlens`` must come from a validated builder:
    :func:`validate_cu_seqlens` on the host lists, once per batch (the trainer's packing does this)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [N+1] (0, end of doc 1, ..., T)")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an integer tensor (int32), got {cu_seqlens.dtype}")
    if cu_seqlens.is_cpu:
        validate_cu_seqlens(cu_seqlens.tolist(), t)


def validate_cu_seqlens(cu: list[int], t: int) -> None:
    """The value rules of ``cu_seqlens`` on a host list: starts at 0, ends at T, non-decreasing."""
    if cu[0] != 0 or cu[-1] != t:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={t}, got {cu[0]} .. {cu[-1]}")
    if any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError("cu_seqlens must be non-decreasing")



def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    backend: str | Backend | None = None,
) -> torch.Tensor:
    """Causal attention over packed documents, with optional sliding window and sinks.

    Args:
        q: [T, Hq, D]; k: [T, Hkv, D]; v: [T, Hkv, Dv] (Dv may differ from D), one dtype.
        cu_seqlens: integer [N+1], 0 first, T last: document i is tokens cu[i]:cu[i+1].
        scale: logit scale, default D ** -0.5.
        window: None (full causal) or W >= 1: a query sees its W most recent keys, itself included.
        sinks: None or [Hq]: unscaled per-head logit in the softmax denominator only.
        backend: None (``default_backend()``: the selection rule's choice), a backend name, or a Backend object.

    Returns:
        [T, Hq, Dv] in q's dtype, differentiable in q, k, v and sinks.
    """
    _check_common(q, k, v, window, sinks, ndim=3)
    t = q.shape[0]
    if k.shape[0] != t or v.shape[0] != t:
        raise ValueError(f"q, k, v must have the same number of tokens, got {t}, {k.shape[0]}, {v.shape[0]}")
    _check_cu_seqlens(cu_seqlens, t)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    from polyrl.core.plugins.selection import backend_for

    return backend_for(backend).varlen_attention(q, k, v, cu_seqlens, scale=float(scale), window=window, sinks=sinks)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    backend: str | Backend | None = None,
) -> torch.Tensor:
    """Attention of the last ``Sq`` positions of each row over its KV cache (generation form).

    Query i of a row sits at key position ``Sk - Sq + i`` (bottom-right aligned) and sees keys j with
    ``j <= Sk - Sq + i``, ``(Sk - Sq + i) - j < window`` and ``key_padding_mask[b, j]``. Positions count
    cache slots, padding included (as transformers' masks do). A query with no visible key (a padded
    position of a left-padded prompt) returns zeros.

    Validated here, then run by the backend's ``decode_attention`` (its ``decode_attention_kernel`` slot): the
    fp32 dense reference of :mod:`polyrl.core.attention.reference` (``reference_decode_attention``: chunked over
    queries, differentiable through ordinary autograd) unless the backend ships a decoding kernel. The cuda
    backend ships a forward-only Triton kernel (polyrl.backends.cuda.decode) that falls back to the reference
    when an input requires grad or for float64.

    Args:
        q: [B, Sq, Hq, D]; k_cache: [B, Sk, Hkv, D]; v_cache: [B, Sk, Hkv, Dv]; Sq <= Sk.
        key_padding_mask: None or bool [B, Sk], True for real tokens.
        scale: logit scale, default D ** -0.5.
        window: None (full causal) or W >= 1: a query sees the W most recent cache slots, itself included.
        sinks: None or [Hq]: unscaled per-head logit in the softmax denominator only.
        backend: None (``default_backend()``: the selection rule's choice), a backend name, or a Backend object.

    Returns:
        [B, Sq, Hq, Dv] in q's dtype.
    """
    _check_common(q, k_cache, v_cache, window, sinks, ndim=4)
    b, sq, _, d = q.shape
    sk = k_cache.shape[1]
    if k_cache.shape[0] != b or v_cache.shape[:2] != k_cache.shape[:2]:
        raise ValueError(
            f"batch/length mismatch: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if sq > sk:
        raise ValueError(f"decode_attention needs q_len <= k_len (queries at the end of the cache), got {sq} > {sk}")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (b, sk):
        raise ValueError(f"key_padding_mask must have shape [B, Sk] = [{b}, {sk}], got {tuple(key_padding_mask.shape)}")
    if scale is None:
        scale = d**-0.5
    from polyrl.core.plugins.selection import backend_for

    return backend_for(backend).decode_attention(q, k_cache, v_cache, key_padding_mask=key_padding_mask,
                                                 scale=float(scale), window=window, sinks=sinks)
