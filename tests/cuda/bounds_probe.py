"""A Triton kernel that writes the band ranges of kernels/bounds.py for the tile starting at each token, so a
test can check them against brute force (test_attention_interpret.py; runs under the interpreter)."""

from __future__ import annotations

import triton
import triton.language as tl

from polyrl.backends.cuda.kernels.bounds import band_key_range, band_query_range


@triton.jit
def band_bounds_probe(doc_start_ptr, doc_end_ptr, out_ptr, T, W, BLOCK: tl.constexpr):
    a = tl.program_id(0)
    lo, hi = band_key_range(doc_start_ptr, a, T, W, BLOCK)
    c, qhi = band_query_range(doc_end_ptr, a, T, W, BLOCK)
    tl.store(out_ptr + a * 4, lo)
    tl.store(out_ptr + a * 4 + 1, hi)
    tl.store(out_ptr + a * 4 + 2, c)
    tl.store(out_ptr + a * 4 + 3, qhi)
