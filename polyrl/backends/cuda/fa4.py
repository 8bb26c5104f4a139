"""``fa4_varlen_attention``: polyrl's attention contract on FlashAttention-4 (``flash_attn.cute``).

The translation (FA4's arguments: polyrl.backends.cuda.attention_choice's docstring):
- every argument by keyword (FA4's fourth positional parameter is ``qv``, not the cu_seqlens);
- window W (the W most recent keys, the query included) -> ``window_size=(W - 1, 0)``; no window -> plain causal;
- sinks [Hq] -> ``learnable_sink`` in fp32, unscaled (FA4 adds them to the softmax denominator as natural-log
  logits, which is polyrl's definition); their gradient comes back through the cast in the sinks' dtype;
- ``max_seqlen_q`` / ``max_seqlen_k``: the longest document, read from cu_seqlens once per cu_seqlens object (one
  host sync per forward, not per layer; the same cache rule as the Triton kernel's ``_doc_bounds``);
- ``deterministic=True`` unless ``POLYRL_FA4_DETERMINISTIC=0``: the rest of polyrl's training is bitwise
  reproducible, and FA4's default backward accumulates dQ in no fixed order.
"""

from __future__ import annotations

import os

import torch

from polyrl.backends.cuda.attention_choice import fa4_function
from polyrl.backends.cuda.per_batch import LastBatch
from polyrl.core.errors import BadInputError

DETERMINISTIC_ENV = "POLYRL_FA4_DETERMINISTIC"

def _longest(cu_seqlens: torch.Tensor, T: int) -> int:
    return int(torch.diff(cu_seqlens).max()) if cu_seqlens.numel() > 1 else 0  # one host read


_LONGEST = LastBatch(_longest)


def max_seqlen(cu_seqlens: torch.Tensor, T: int) -> int:
    """The longest document of ``cu_seqlens`` (one host read), once per forward (polyrl.backends.cuda.per_batch:
    every layer passes the same cu_seqlens object)."""
    return _LONGEST.get(cu_seqlens, T)


def deterministic() -> bool:
    """``POLYRL_FA4_DETERMINISTIC``: unset or 1 -> True (the default), 0 -> False."""
    value = os.environ.get(DETERMINISTIC_ENV, "1").strip()
    if value not in ("0", "1"):
        raise BadInputError(f"{DETERMINISTIC_ENV}={value!r}: expected 1 (deterministic backward, the default) or 0")
    return value == "1"


def fa4_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Packed causal attention (contract: polyrl.core.attention) on FA4: q [T, Hq, D], k [T, Hkv, D],
    v [T, Hkv, Dv] -> [T, Hq, Dv] in q's dtype, differentiable in q, k, v and sinks."""
    T = q.shape[0]
    longest = max_seqlen(cu_seqlens, T)
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous() else \
        cu_seqlens.to(torch.int32).contiguous()
    out, _lse = fa4_function()(
        q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
        softmax_scale=float(scale), causal=True,
        window_size=(window - 1, 0) if window is not None else (None, None),
        learnable_sink=sinks.float() if sinks is not None else None,
        deterministic=deterministic(),
    )
    return out if out.dtype == q.dtype else out.to(q.dtype)
