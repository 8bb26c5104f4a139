"""The cuda backend's Triton decode kernel on a real GPU: bf16 / fp16 / fp32 against the core reference on the same
inputs at GPT-OSS decode shapes (B 512, 64 / 8 heads, D 64, a 256-slot cache, window 128, sinks, left padding) and
DeepSeek MLA head dims (192 / 128), through the slot the engine calls. Skipped cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch
from decode_cases import assert_matches_reference, make_decode_case, visible_rows

from polyrl.core.attention.reference import reference_decode_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (B, Sq, Sk, Hq, Hkv, D, Dv, window, sink): GPT-OSS's sliding and full layers at a decode step; DeepSeek-V3's MLA
# (decompressed per-head K / V, 192 / 128) with several queries per row.
SHAPES = {
    "gpt_oss_sliding": (512, 1, 256, 64, 8, 64, 64, 128, True),
    "gpt_oss_full": (512, 1, 256, 64, 8, 64, 64, None, True),
    "deepseek_mla": (64, 2, 300, 16, 16, 192, 128, None, False),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_decode_kernel_matches_the_reference(shape, dtype):
    from polyrl.backends.cuda.decode import decode_route, triton_decode_attention

    b, sq, sk, hq, hkv, d, dv, window, sink = SHAPES[shape]
    pads = [(r * 37) % (sk + 1) for r in range(b)]  # ragged left padding, a few fully padded rows included
    q, k, v, mask, sinks = make_decode_case(b, sq, sk, hq, hkv, d, dv, dtype, pads=pads, sink=sink, seed=b + d,
                                            device="cuda", head_major=True)
    scale = d**-0.5
    with torch.no_grad():
        assert decode_route(q, k, v, sinks) == "triton"
        got = triton_decode_attention(q, k, v, key_padding_mask=mask, scale=scale, window=window, sinks=sinks)
        again = triton_decode_attention(q, k, v, key_padding_mask=mask, scale=scale, window=window, sinks=sinks)
        want = reference_decode_attention(q, k, v, key_padding_mask=mask, scale=scale, window=window, sinks=sinks)
    assert torch.equal(got, again), "not bitwise reproducible"
    assert_matches_reference(got, want, dtype, visible_rows(b, sq, sk, hq, mask, window))


def test_gpu_decode_with_grad_falls_back_to_the_reference():
    from polyrl.backends.cuda.decode import triton_decode_attention

    q, k, v, mask, sinks = make_decode_case(4, 1, 64, 8, 2, 64, 64, torch.bfloat16, pads=[0, 5, 63, 64], sink=True,
                                            seed=1, device="cuda")
    q.requires_grad_()
    out = triton_decode_attention(q, k, v, key_padding_mask=mask, scale=0.125, window=16, sinks=sinks)
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
