"""The cuda backend's Triton decode kernel (polyrl/backends/cuda/kernels/decode.py) on CPU tensors under
TRITON_INTERPRET=1 (set by conftest.py), against the core reference ``reference_decode_attention`` on the same
inputs: fp32 at the fp32 attention bars (accumulation order only), fp16 at the fp16 bars (the kernel also rounds P
to fp16 before P.V, as flash kernels do; bf16 arithmetic is wrong in the interpreter, so bf16 is the gpu tests').

The cases cross the interpreter's 16-key tiles (caches of 1..40 slots), put windows inside and across tiles, pad
rows by different amounts (one row entirely, one whose first queries sit on padding and must return zeros), and run
GQA ratios 1 / 2 / 3 / 4 (16-row q tiles, so G = 3 and 4 leave idle rows) with D != Dv, including head dims that
are not powers of two. The wrapper's fallbacks (gradients, float64, POLYRL_CUDA_DECODE=reference) are checked too.
"""

from __future__ import annotations

import os

import pytest
import torch
from decode_cases import assert_matches_reference, make_decode_case, visible_rows

from polyrl.core.attention.reference import reference_decode_attention
from polyrl.core.errors import BadInputError

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="interpreter tests run on CPU-only machines (the gpu tests cover CUDA)",
)


def _kernel():
    from polyrl.backends.cuda.decode import launch_decode_kernel

    return launch_decode_kernel


def _run(case, *, window, scale=None, dtype):
    q, k, v, mask, sinks = case
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    got = _kernel()(q, k, v, key_padding_mask=mask, scale=scale, window=window, sinks=sinks)
    want = reference_decode_attention(q, k, v, key_padding_mask=mask, scale=scale, window=window, sinks=sinks)
    b, sq, hq, _ = q.shape
    assert_matches_reference(got, want, dtype, visible_rows(b, sq, k.shape[1], hq, mask, window))
    return got, want


# (B, Sq, Sk, Hq, Hkv, D, Dv, window, sink, pads, scale, dtype)
GRID = [
    (1, 1, 1, 2, 2, 16, 16, None, False, None, None, torch.float32),  # one slot, MHA
    (4, 1, 37, 8, 2, 32, 32, None, True, [0, 3, 17, 36], None, torch.float32),  # decode step, G = 4, ragged pads
    (3, 4, 20, 4, 2, 48, 32, 3, True, [0, 18, 5], 0.37, torch.float32),  # Sq > 1; row 1's first two queries on padding
    (2, 1, 40, 3, 3, 24, 40, 1, False, [0, 10], None, torch.float32),  # window 1, D 24 / Dv 40 (not powers of 2)
    (2, 3, 33, 8, 2, 16, 16, 100, True, [4, 0], None, torch.float32),  # window beyond the cache
    (3, 2, 25, 6, 3, 64, 64, 16, False, None, None, torch.float32),  # window across tiles, no mask, G = 2
    (2, 2, 9, 4, 1, 16, 16, None, False, [9, 2], None, torch.float32),  # a fully padded row: zeros, no sinks
    (2, 2, 9, 4, 1, 16, 16, 3, True, [9, 8], None, torch.float32),  # the same with sinks and a window
    (2, 5, 30, 6, 2, 32, 16, 3, True, [0, 12], None, torch.float32),  # G = 3 (padded rows), Dv < D
    (4, 1, 40, 8, 2, 32, 32, 3, True, [0, 7, 30, 39], None, torch.float16),
    (2, 3, 17, 4, 1, 24, 40, None, False, [0, 16], None, torch.float16),
    (3, 2, 21, 6, 6, 48, 32, 1, True, [2, 0, 20], 0.2, torch.float16),
    (2, 1, 34, 6, 2, 64, 64, 20, True, [5, 0], None, torch.float16),
]


@pytest.mark.parametrize(("b", "sq", "sk", "hq", "hkv", "d", "dv", "window", "sink", "pads", "scale", "dtype"), GRID)
def test_kernel_matches_the_reference(b, sq, sk, hq, hkv, d, dv, window, sink, pads, scale, dtype):
    case = make_decode_case(b, sq, sk, hq, hkv, d, dv, dtype, pads=pads, sink=sink, seed=b + sq + sk + hq + d)
    _run(case, window=window, scale=scale, dtype=dtype)


@pytest.mark.parametrize("sk", [1, 2, 3, 15, 16, 17, 31, 32, 33, 40])
@pytest.mark.parametrize("window", [None, 3])
def test_every_cache_length_across_tile_edges(sk, window):
    sq = min(sk, 2)
    pads = [0, sk // 2]
    case = make_decode_case(2, sq, sk, 4, 2, 16, 16, torch.float32, pads=pads, sink=True, seed=sk)
    _run(case, window=window, dtype=torch.float32)


def test_head_major_views_and_a_sliced_mask_as_transformers_hands_them():
    """q, k, v are [B, H, S, D] tensors transposed (not contiguous in S), the mask a slice of a wider one."""
    q, k, v, _, sinks = make_decode_case(3, 1, 26, 8, 2, 32, 32, torch.float32, sink=True, seed=7, head_major=True)
    assert not k.is_contiguous() and not v.is_contiguous()  # (q: Sq = 1, a transposed view is contiguous)
    wide = torch.arange(30)[None, :] >= torch.tensor([2, 9, 27])[:, None]
    mask = wide[:, 2:28]  # 26 keys, strides of the 30-wide tensor
    _run((q, k, v, mask, sinks), window=5, dtype=torch.float32)


def test_padded_head_dims_are_never_read_past_d():
    """D = 24 and Dv = 40 run as 32 / 64-wide tiles: the columns past D / Dv of a strided cache (here NaN) must be
    masked out of the loads, not merely multiplied by the zero padding of q (0 x NaN is NaN)."""
    q, k, v, mask, sinks = make_decode_case(2, 2, 19, 4, 2, 24, 40, torch.float32, pads=[0, 5], sink=True, seed=10)

    def nan_padded(x, width):
        wide = torch.full((*x.shape[:-1], width), float("nan"))
        wide[..., : x.shape[-1]] = x
        return wide[..., : x.shape[-1]]  # last dim contiguous, NaN right after it in memory

    case = (nan_padded(q, 32), nan_padded(k, 32), nan_padded(v, 64), mask, sinks)
    _run(case, window=None, dtype=torch.float32)


def test_queries_that_see_no_key_are_zero_and_others_finite():
    q, k, v, mask, _ = make_decode_case(2, 3, 7, 4, 2, 16, 16, torch.float32, pads=[7, 5], sink=False, seed=3)
    out = _kernel()(q, k, v, key_padding_mask=mask, scale=0.25, window=None, sinks=None)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # the whole row is padding
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))  # query at slot 4 < the first real slot 5
    assert out[1, 1:].abs().sum() > 0


def test_empty_batch_launches_nothing():
    q, k, v, _, _ = make_decode_case(0, 1, 5, 4, 2, 16, 16, torch.float32, seed=0)
    assert _kernel()(q, k, v, key_padding_mask=None, scale=0.25, window=None, sinks=None).shape == (0, 1, 4, 16)


# --- the slot: what runs, and the fallbacks ----------------------------------------------------------------------


def _slot():
    from polyrl.backends.cuda.decode import triton_decode_attention

    return triton_decode_attention


def test_the_slot_runs_the_kernel_without_gradients(monkeypatch):
    from polyrl.backends.cuda import decode as decode_module

    monkeypatch.delenv("POLYRL_CUDA_DECODE", raising=False)
    q, k, v, mask, sinks = make_decode_case(2, 1, 19, 4, 2, 16, 16, torch.float32, pads=[0, 4], sink=True, seed=4)
    assert decode_module.decode_route(q, k, v, sinks) == "triton"
    got = _slot()(q, k, v, key_padding_mask=mask, window=5, sinks=sinks)  # scale: the default D ** -0.5
    assert torch.equal(got, _kernel()(q, k, v, key_padding_mask=mask, scale=16**-0.5, window=5, sinks=sinks))


def test_requires_grad_falls_back_to_the_reference_with_its_gradients():
    from polyrl.backends.cuda.decode import decode_route

    q, k, v, mask, sinks = make_decode_case(2, 2, 13, 4, 2, 16, 24, torch.float32, pads=[0, 3], sink=True, seed=5)
    d_out = torch.randn(2, 2, 4, 24, generator=torch.Generator().manual_seed(0))
    results = []
    for fn in (_slot(), reference_decode_attention):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
        out = fn(leaves[0], leaves[1], leaves[2], key_padding_mask=mask, scale=0.3, window=4, sinks=leaves[3])
        out.backward(d_out)
        results.append([out.detach(), *(x.grad for x in leaves)])
    for got, want in zip(*results):
        assert got is not None and torch.equal(got, want)
    assert decode_route(q.requires_grad_(), k, v, sinks).startswith("reference (an input requires grad")
    with torch.no_grad():  # the engine's case: requires_grad parameters' outputs, autograd off -> the kernel
        assert decode_route(q, k, v, sinks) == "triton"
    sinks_only = sinks.clone().requires_grad_()
    assert decode_route(q.detach(), k, v, sinks_only).startswith("reference")


def test_float64_falls_back_to_the_reference():
    from polyrl.backends.cuda.decode import decode_route

    q, k, v, mask, sinks = make_decode_case(2, 1, 11, 4, 2, 16, 16, torch.float64, pads=[0, 2], sink=True, seed=6)
    assert decode_route(q, k, v, sinks).startswith("reference (float64")
    got = _slot()(q, k, v, key_padding_mask=mask, scale=0.25, window=None, sinks=sinks)
    want = reference_decode_attention(q, k, v, key_padding_mask=mask, scale=0.25, window=None, sinks=sinks)
    assert got.dtype == torch.float64 and torch.equal(got, want)


def test_the_environment_forces_the_reference_and_refuses_other_values(monkeypatch):
    from polyrl.backends.cuda.decode import decode_report, decode_route

    q, k, v, mask, sinks = make_decode_case(1, 1, 5, 2, 1, 16, 16, torch.float32, seed=8)
    monkeypatch.setenv("POLYRL_CUDA_DECODE", "reference")
    assert decode_route(q, k, v, sinks) == "reference (POLYRL_CUDA_DECODE=reference)"
    got = _slot()(q, k, v, key_padding_mask=mask, scale=0.25, window=None, sinks=sinks)
    assert torch.equal(got, reference_decode_attention(q, k, v, scale=0.25))
    assert decode_report() == {"all": "reference (POLYRL_CUDA_DECODE=reference)"}
    monkeypatch.setenv("POLYRL_CUDA_DECODE", "flash")
    with pytest.raises(BadInputError, match=r"^POLYRL_CUDA_DECODE='flash': expected one of triton, reference$"):
        _slot()(q, k, v, key_padding_mask=mask, scale=0.25, window=None, sinks=sinks)
    assert decode_report()["all"].startswith("error (POLYRL_CUDA_DECODE='flash'")


def test_the_cuda_backend_routes_its_decode_slot_to_the_kernel():
    """Backend.decode_attention and the public op with backend= both reach the Triton kernel (no CUDA needed: the
    interpreter runs it on CPU tensors)."""
    from polyrl.backends.cuda import CudaBackend
    from polyrl.core.attention import decode_attention

    backend = CudaBackend()
    assert "decode_attention" in backend.provided_kernels()
    q, k, v, mask, sinks = make_decode_case(2, 1, 18, 8, 2, 32, 32, torch.float32, pads=[0, 6], sink=True, seed=9)
    want = _kernel()(q, k, v, key_padding_mask=mask, scale=0.2, window=7, sinks=sinks)
    got = backend.decode_attention(q, k, v, key_padding_mask=mask, scale=0.2, window=7, sinks=sinks)
    assert torch.equal(got, want)
    assert torch.equal(decode_attention(q, k, v, key_padding_mask=mask, scale=0.2, window=7, sinks=sinks,
                                        backend=backend), want)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_conformance_kits_decode_cases_pass_on_the_kernel(dtype):
    """The kit's decode checks (polyrl.testing.conformance.DECODE_CASES) on a CPU backend whose decode slot is the
    cuda backend's: the kit's fp64 oracle agrees with the kernel, not only the core reference does."""
    from polyrl.backends.cpu import CpuBackend
    from polyrl.testing.conformance import DECODE_CASES, PASS, decode_checks

    class CpuWithTritonDecode(CpuBackend):
        name = "cpu_triton_decode"
        is_reference = False
        decode_attention_kernel = "polyrl.backends.cuda.decode:triton_decode_attention"

    backend = CpuWithTritonDecode()
    assert backend.provided_kernels() == frozenset({"decode_attention"})
    checks = decode_checks(backend, dtype)
    assert len(checks) == len(DECODE_CASES) and all(c.status == PASS for c in checks), [c.detail for c in checks]
