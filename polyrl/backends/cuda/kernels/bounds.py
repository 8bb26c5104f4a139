"""The key range of a q tile, shared by the forward and the dQ kernels (they walk the same keys).

A q tile holds tokens ``a .. a + BLOCK_T - 1`` (clipped to T). Its visible keys lie in ``[lo, last]``:
``lo`` is the first token's document start (or its window start), ``last`` the tile's last token. The range is
cut into three BLOCK_N-aligned pieces so that only edge tiles pay for masks:
``[k_start, s1)`` masked lower edge (document or window start of some row), ``[s1, s2)`` fully visible to
every row, ``[s2, k_end)`` masked diagonal.

The band variant (``BAND`` in the kernels, for short windows) walks one masked loop over exactly the keys some
row of the tile can see, not rounded to BLOCK_N: ``[max(doc_start[a], a - W + 1), last]`` for a q tile (both
bounds are attained by its first and last row, since doc_start and t - W + 1 only grow with t), and for a key
tile ``[c, min(doc_end[last_j] - 1, last_j + W - 1)]`` queries. Loads need no alignment (every token row is
its own contiguous chunk of D elements), so a window of W keys costs ``cdiv(W + BLOCK_T - 1, BLOCK_N)`` key
tiles per q tile (W = 128, 16 tokens a tile: 2 tiles of 128 or 3 of 64). The aligned ranges reach the same
count when W is a multiple of BLOCK_N and BLOCK_T divides BLOCK_N (the GPT-OSS case) and one tile more
otherwise; what the band changes there is the loop: one loop of 2-3 iterations that Triton can software-
pipeline, where the aligned split gives three loops of about one iteration each (nothing to overlap).
Rows outside their keys are masked, so covering a superset is always correct; these bounds only decide how
much is visited.
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


@triton.jit
def band_key_range(doc_start_ptr, a, T, W, BLOCK_T: tl.constexpr):
    """Exact keys ``[lo, hi)`` seen by some row of the q tile starting at token a (window set)."""
    last = tl.minimum(a + BLOCK_T, T) - 1
    lo = tl.maximum(tl.load(doc_start_ptr + a), a - W + 1)
    return lo, last + 1


@triton.jit
def band_query_range(doc_end_ptr, c, T, W, BLOCK_N: tl.constexpr):
    """Exact queries ``[c, hi)`` that see some key of the key tile starting at token c (window set)."""
    last_j = tl.minimum(c + BLOCK_N, T) - 1
    hi = tl.minimum(tl.load(doc_end_ptr + last_j), last_j + W)
    return c, hi
