"""The key range of a q tile, shared by the forward and the dQ kernels (they walk the same keys).

A q tile holds tokens ``a .. a + BLOCK_T - 1`` (clipped to T). Its visible keys lie in ``[lo, last]``:
``lo`` is the first token's document start (or its window start), ``last`` the tile's last token. The range is
cut into three BLOCK_N-aligned pieces so that only edge tiles pay for masks:
``[k_start, s1)`` masked lower edge (document or window start of some row), ``[s1, s2)`` fully visible to
every row, ``[s2, k_end)`` masked diagonal.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def key_ranges(doc_start_ptr, a, T, W, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    last = tl.minimum(a + BLOCK_T, T) - 1
    lo = tl.load(doc_start_ptr + a)  # first row's document start
    full_lo = tl.load(doc_start_ptr + last)  # keys from here on are in every row's document
    if HAS_WINDOW:
        lo = tl.maximum(lo, a - W + 1)
        full_lo = tl.maximum(full_lo, last - W + 1)
    k_start = (lo // BLOCK_N) * BLOCK_N
    k_end = last + 1
    s1 = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, k_start), k_end)
    s2 = tl.minimum(tl.maximum(((a + 1) // BLOCK_N) * BLOCK_N, s1), k_end)
    return k_start, s1, s2, k_end
