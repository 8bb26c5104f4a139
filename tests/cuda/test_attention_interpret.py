"""The Triton kernels of the cuda backend, run on CPU tensors under TRITON_INTERPRET=1 (see conftest.py).

fp32 inputs check the math exactly (1e-5 against fp64); fp16 checks the low-precision tile path (bf16
arithmetic is wrong in the interpreter, docs/background.md §7, so bf16 is covered by the gpu tests). Shapes are tiny
(interpreter ~100x slower than torch) but chosen so tiles straddle documents, windows start mid-tile, and the
unmasked interior loop, both masked edge loops and padded GQA groups (G = 3) all run with the 16x16 tiles the
interpreter config uses.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from cuda_attention_cases import VARIANTS, make_case, run_both

from polyrl.core.tolerances import check_close

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="interpreter tests run on CPU-only machines (the gpu tests cover CUDA)",
)


def _attn():
    from polyrl.backends.cuda.attention import triton_varlen_attention

    return triton_varlen_attention


# (lengths, Hq, Hkv, D, Dv, window, sink, dtype)
GRID = [
    ([70], 4, 1, 16, 16, None, True, torch.float32),  # one document: interior tiles, G = 4
    ([23, 1, 40, 9], 4, 2, 16, 16, None, True, torch.float32),  # ragged, a 1-token document
    ([50, 31], 6, 2, 16, 16, 7, True, torch.float32),  # window inside a tile, G = 3 (padded to 4)
    ([90], 2, 2, 32, 32, 33, False, torch.float32),  # window across tiles, MHA, no sink
    ([17, 60], 8, 2, 16, 16, 1, True, torch.float32),  # window 1: only the diagonal
    ([40, 25], 4, 4, 16, 16, 200, True, torch.float32),  # window longer than every document
    ([37, 29], 4, 2, 24, 8, 5, True, torch.float32),  # D != Dv and D not a power of two (MLA route)
    ([64, 19], 4, 1, 16, 16, None, True, torch.float16),
    ([45, 33], 8, 4, 32, 32, 12, True, torch.float16),
    ([52], 3, 1, 16, 16, None, False, torch.float16),
]


@pytest.mark.parametrize(("lengths", "hq", "hkv", "d", "dv", "window", "sink", "dtype"), GRID)
def test_interpreted_kernels_match_fp64_oracle(lengths, hq, hkv, d, dv, window, sink, dtype):
    q, k, v, sinks, cu, d_out = make_case(lengths, hq, hkv, d, dv, dtype, sink, seed=len(lengths) + hq + d)
    got, want = run_both(_attn(), q, k, v, sinks, cu, d_out, window=window)
    assert got["out"].dtype == dtype and got["out"].shape == (sum(lengths), hq, dv)
    for name in got:
        kind = "attention.forward" if name == "out" else "attention.grad"
        err, bar, ok = check_close(kind, got[name], want[name], dtype)
        assert ok, f"{name}: relative error {err:.2e} > {bar:.0e}"


def test_interpreted_kernels_match_core_reference():
    from polyrl.core.attention.reference import reference_varlen_attention

    q, k, v, sinks, cu, d_out = make_case([33, 48], 4, 2, 16, 16, torch.float32, True, seed=3)
    got, _ = run_both(_attn(), q, k, v, sinks, cu, d_out, window=20)
    ref, _ = run_both(reference_varlen_attention, q, k, v, sinks, cu, d_out, window=20)
    for name in got:
        kind = "attention.forward" if name == "out" else "attention.grad"
        err, bar, ok = check_close(kind, got[name], ref[name], torch.float32)
        assert ok, f"{name}: {err:.2e} > {bar:.0e}"


def test_backward_is_deterministic_and_dsink_is_exact():
    q, k, v, sinks, cu, d_out = make_case([41, 30], 4, 2, 16, 16, torch.float32, True, seed=5)
    first, want = run_both(_attn(), q, k, v, sinks, cu, d_out, window=None)
    second, _ = run_both(_attn(), q, k, v, sinks, cu, d_out, window=None)
    for name in first:
        assert torch.equal(first[name], second[name]), f"{name} differs between two identical runs"
    # The sink gradient is a sum of T small terms per head: exact to fp32 accumulation, not approximate.
    assert torch.allclose(first["dsinks"].double(), want["dsinks"], rtol=1e-5, atol=1e-6)
    assert first["dsinks"].abs().min() > 0  # every head's sink takes probability mass


def test_sink_changes_output_like_an_extra_key():
    """A very negative sink is no sink; a huge one drives the output to zero (all mass on the sink)."""
    attn = _attn()
    q, k, v, _, cu, _ = make_case([30], 2, 1, 16, 16, torch.float32, False, seed=7)
    plain = attn(q, k, v, cu, scale=0.25, window=None, sinks=None)
    low = attn(q, k, v, cu, scale=0.25, window=None, sinks=torch.full((2,), -1e4))
    high = attn(q, k, v, cu, scale=0.25, window=None, sinks=torch.full((2,), 1e4))
    torch.testing.assert_close(low, plain, rtol=0, atol=1e-6)
    assert high.abs().max() < 1e-6


def test_rejects_bad_head_ratio():
    q, k, v, _, cu, _ = make_case([8], 3, 2, 16, 16, torch.float32, False, seed=0)
    with pytest.raises(ValueError, match="multiple"):
        _attn()(q, k, v, cu, scale=0.25, window=None, sinks=None)


# The corners of the attention issue's grid the table above does not reach: window 3, GQA ratios 2 and 8,
# sinks of +-30 (sink dominant / negligible), a 300-token document beside 1-token ones.
EXTREME_SINKS = [
    ([1, 37, 130, 5], 2, 1, 16, 16, 3),
    ([1, 37, 130, 5], 8, 1, 16, 16, 128),
    ([300, 1], 2, 2, 16, 16, None),
]


@pytest.mark.parametrize(("lengths", "hq", "hkv", "d", "dv", "window"), EXTREME_SINKS)
@pytest.mark.parametrize("sink_value", [30.0, -30.0])
def test_interpreted_kernels_with_extreme_sinks(lengths, hq, hkv, d, dv, window, sink_value):
    q, k, v, _, cu, d_out = make_case(lengths, hq, hkv, d, dv, torch.float32, False, seed=hq + (window or 0))
    # alternate the sign across heads so one call has both a dominant and a negligible sink
    sinks = sink_value * torch.tensor([(-1.0) ** h for h in range(hq)])
    got, want = run_both(_attn(), q, k, v, sinks, cu, d_out, window=window)
    for name in got:
        kind = "attention.forward" if name == "out" else "attention.grad"
        err, bar, ok = check_close(kind, got[name], want[name], torch.float32)
        assert ok, f"{name}: relative error {err:.2e} > {bar:.0e}"


# --- the opt-in kernel paths (polyrl.backends.cuda.attention.KernelOptions) -----------------------------------
def _options(**kw):
    from polyrl.backends.cuda.attention import KernelOptions

    return KernelOptions(**kw)


# (variant, lengths, Hq, Hkv, D, Dv, window, sink, dtype). "all" (the three switches together) runs on every
# layout: causal over several tiles, ragged with 1-token documents, a padded group (G = 3), windows inside a
# tile / across tiles / of one key / longer than the documents, D != Dv, fp16; each switch alone on a few.
VARIANT_GRID = [
    ("all", [70], 4, 1, 16, 16, None, True, torch.float32),
    ("all", [23, 1, 40, 9], 4, 2, 16, 16, None, True, torch.float32),
    ("all", [50, 31], 6, 2, 16, 16, 7, True, torch.float32),
    ("all", [90], 2, 2, 32, 32, 33, False, torch.float32),
    ("all", [17, 1, 60], 8, 2, 16, 16, 1, True, torch.float32),
    ("all", [40, 25], 4, 4, 16, 16, 200, True, torch.float32),
    ("all", [37, 29], 4, 2, 24, 8, 5, True, torch.float32),
    ("all", [45, 33], 8, 4, 32, 32, 12, True, torch.float16),
    ("atomic", [23, 1, 40, 9], 4, 2, 16, 16, None, True, torch.float32),
    ("atomic", [50, 31], 6, 2, 16, 16, 7, True, torch.float32),
    ("atomic", [64, 19], 4, 1, 16, 16, None, True, torch.float16),
    ("band", [50, 31], 6, 2, 16, 16, 7, True, torch.float32),
    ("aligned", [50, 31], 6, 2, 16, 16, 7, True, torch.float32),  # the former default, now opt-in
    ("aligned", [17, 1, 60], 8, 2, 16, 16, 1, True, torch.float32),
    ("band", [90], 2, 2, 32, 32, 33, False, torch.float32),
    ("table", [37, 29], 4, 2, 24, 8, 5, True, torch.float32),
]


@pytest.mark.parametrize(("variant", "lengths", "hq", "hkv", "d", "dv", "window", "sink", "dtype"), VARIANT_GRID)
def test_interpreted_kernel_paths_match_fp64_oracle(variant, lengths, hq, hkv, d, dv, window, sink, dtype):
    attn = functools.partial(_attn(), options=_options(**VARIANTS[variant]))
    q, k, v, sinks, cu, d_out = make_case(lengths, hq, hkv, d, dv, dtype, sink, seed=len(lengths) + hq + d)
    got, want = run_both(attn, q, k, v, sinks, cu, d_out, window=window)
    for name in got:
        kind = "attention.forward" if name == "out" else "attention.grad"
        err, bar, ok = check_close(kind, got[name], want[name], dtype)
        assert ok, f"{variant} {name}: relative error {err:.2e} > {bar:.0e}"
    if sink and dtype == torch.float32:  # the sink gradient stays exact on every path
        assert torch.allclose(got["dsinks"].double(), want["dsinks"], rtol=1e-5, atol=1e-6)


def test_interpreted_atomic_band_paths_with_extreme_sinks():
    # sinks of +30 and -30 on alternate heads: dominant and negligible in one call
    q, k, v, _, cu, d_out = make_case([1, 37, 130, 5], 8, 1, 16, 16, torch.float32, False, seed=3)
    sinks = 30.0 * torch.tensor([(-1.0) ** h for h in range(8)])
    attn = functools.partial(_attn(), options=_options(**VARIANTS["all"]))
    got, want = run_both(attn, q, k, v, sinks, cu, d_out, window=3)
    for name in got:
        kind = "attention.forward" if name == "out" else "attention.grad"
        err, bar, ok = check_close(kind, got[name], want[name], torch.float32)
        assert ok, f"{name}: relative error {err:.2e} > {bar:.0e}"


def test_atomic_backward_writes_dk_dv_once_and_dq_close_to_two_pass():
    """dK/dV are still written by one program each (bitwise equal to the two-pass kernels' sums up to the
    same fp32 order); dQ differs from the two-pass dQ only by fp32 summation order."""
    q, k, v, sinks, cu, d_out = make_case([29, 20], 4, 2, 16, 16, torch.float32, True, seed=5)
    atomic = functools.partial(_attn(), options=_options(bwd="atomic"))
    first, _ = run_both(atomic, q, k, v, sinks, cu, d_out, window=None)
    second, _ = run_both(atomic, q, k, v, sinks, cu, d_out, window=None)
    two_pass, _ = run_both(_attn(), q, k, v, sinks, cu, d_out, window=None)
    for name in ("out", "dk", "dv"):
        assert torch.equal(first[name], second[name]), name
        assert torch.equal(first[name], two_pass[name]), f"{name}: fused and two-pass kernels disagree"
    torch.testing.assert_close(first["dq"], two_pass["dq"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(first["dsinks"], two_pass["dsinks"], rtol=1e-5, atol=1e-7)


def test_kernel_options_from_env_and_refusal(monkeypatch):
    from polyrl.backends.cuda.attention import KernelOptions
    from polyrl.core.errors import BadInputError

    monkeypatch.setenv("POLYRL_ATTN_BWD", "atomic")
    monkeypatch.setenv("POLYRL_ATTN_WINDOW_TILES", "band")
    monkeypatch.delenv("POLYRL_ATTN_CONFIGS", raising=False)
    opts = KernelOptions.from_env()
    assert (opts.bwd, opts.window_tiles, opts.configs) == ("atomic", "band", "first")
    assert opts.band(128) and opts.band(256) and not opts.band(257) and not opts.band(None)
    monkeypatch.setenv("POLYRL_ATTN_BWD", "fast")
    with pytest.raises(BadInputError, match=r"POLYRL_ATTN_BWD.*'fast'.*two_pass, atomic"):
        KernelOptions.from_env()
    # the env is read per call: a bad value set after import is refused at the next call, before any kernel
    q, k, v, _, cu, _ = make_case([8], 2, 1, 16, 16, torch.float32, False, seed=0)
    with pytest.raises(BadInputError, match="POLYRL_ATTN_BWD"):
        _attn()(q, k, v, cu, scale=0.25, window=None, sinks=None)


def test_band_bounds_are_exact():
    """band_key_range / band_query_range against brute force over ragged documents, windows and tile starts:
    the range is exactly [first, last + 1) of the keys (queries) that some row of the tile can see."""
    from bounds_probe import band_bounds_probe as probe

    lengths, block = [5, 1, 23, 2, 14], 4
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    t = int(cu[-1])
    doc = torch.searchsorted(cu[1:], torch.arange(t), right=True)
    start, end = cu[doc].int(), cu[doc + 1].int()
    for w in (1, 3, 4, 9, 100):
        out = torch.zeros(t, 4, dtype=torch.int32)
        probe[(t,)](start, end, out, t, w, BLOCK=block)
        for a in range(t):
            rows = range(a, min(a + block, t))
            keys = [j for i in rows for j in range(t) if start[i] <= j <= i and i - j < w]
            assert out[a, :2].tolist() == [min(keys), max(keys) + 1], (w, a)
            cols = range(a, min(a + block, t))
            queries = [i for j in cols for i in range(t) if start[i] <= j <= i and i - j < w]
            assert out[a, 2:].tolist() == [min(queries), max(queries) + 1], (w, a)


def test_config_table_covers_every_kernel_and_head_dim():
    from polyrl.backends.cuda.kernels import configs

    assert [configs.head_dim_class(d, dv) for d, dv in ((16, 16), (64, 64), (128, 128), (192, 128))] == [
        64, 64, 128, 256]
    for kernel in configs.KERNELS:
        for hd in (64, 128, 256):
            for band in (False, True):
                rows = configs._TABLE[(kernel, hd, band)]
                assert rows, (kernel, hd, band)
                for m, n, warps, stages in rows:
                    # power-of-two tiles, a whole GPT-OSS group (G_P = 8) in a row tile, wgmma-sized warps
                    assert m >= 8 and n >= 16 and m & (m - 1) == 0 and n & (n - 1) == 0, (kernel, hd, m, n)
                    assert warps in (4, 8) and 1 <= stages <= 5
    with pytest.raises(ValueError, match="unknown attention kernel"):
        configs.table_configs("bwd", 64, 64, False)


def test_measured_hopper_pick_replaces_the_first_config_only_where_measured(monkeypatch):
    """HOPPER_PICKS: dQ and dK/dV at head dim <= 64 without a window take their measured configs on compute
    capability 9.x; every other launch (a window, larger heads, another kernel, another GPU, autotuning, the
    interpreter) runs the kernel's first config through its autotuner as before."""
    import polyrl.backends.cuda.attention as A
    from polyrl.backends.cuda.kernels import configs as C

    assert C.measured_pick("dq", 64, 64, False, (9, 0)) is None  # under the interpreter: never
    monkeypatch.setattr(C, "interpreting", lambda: False)
    monkeypatch.delenv("POLYRL_TRITON_AUTOTUNE", raising=False)
    pick = C.measured_pick("dq", 64, 64, False, (9, 0))
    assert (pick.kwargs, pick.num_warps, pick.num_stages) == ({"BLOCK_M": 256, "BLOCK_N": 64}, 8, 3)
    assert C.measured_pick("dq", 32, 32, False, (9, 0)) is not None  # head-dim class 64
    pick = C.measured_pick("dkdv", 64, 64, False, (9, 0))
    assert (pick.kwargs, pick.num_warps, pick.num_stages) == ({"BLOCK_M": 64, "BLOCK_N": 64, "PREFETCH": True}, 4, 1)
    pick = C.measured_pick("fwd", 64, 64, False, (9, 0))
    assert (pick.kwargs, pick.num_warps, pick.num_stages) == ({"BLOCK_M": 128, "BLOCK_N": 64, "TMA": True}, 8, 3)
    for args in (("dq", 64, 64, True, (9, 0)), ("dq", 128, 128, False, (9, 0)), ("dq", 192, 128, False, (9, 0)),
                 ("dkdv", 64, 64, True, (9, 0)), ("dkdv", 128, 128, False, (9, 0)), ("fwd", 64, 64, True, (9, 0)),
                 ("dq", 64, 64, False, (8, 0)), ("dkdv", 64, 64, False, (10, 0)),
                 ("dq", 64, 64, False, (10, 0))):
        assert C.measured_pick(*args) is None, args
    monkeypatch.setenv("POLYRL_TRITON_AUTOTUNE", "1")
    assert C.measured_pick("dq", 64, 64, False, (9, 0)) is None

    monkeypatch.delenv("POLYRL_TRITON_AUTOTUNE")
    launched = []

    class _Fn:
        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append(("fn", grid, kw))

    class _Tuner:
        fn = _Fn()

        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append(("autotuner", grid, kw))

    monkeypatch.setattr(A, "_capability", lambda device: (9, 0))
    meta = dict(D=64, DV=64, G_P=8, HAS_WINDOW=False, BAND=False)
    q = torch.zeros(1)
    A._launch(_Tuner(), "dq", "grid", (q,), meta, A.KernelOptions())
    A._launch(_Tuner(), "dq", "grid", (q,), dict(meta, HAS_WINDOW=True, BAND=True), A.KernelOptions())
    A._launch(_Tuner(), "dkdv", "grid", (q,), meta, A.KernelOptions())
    A._launch(_Tuner(), "dkdv", "grid", (q,), dict(meta, HAS_WINDOW=True, BAND=True), A.KernelOptions())
    assert [x[0] for x in launched] == ["fn", "autotuner", "fn", "autotuner"]
    assert launched[0][2] == dict(meta, BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=3)
    assert launched[2][2] == dict(meta, BLOCK_M=64, BLOCK_N=64, PREFETCH=True, num_warps=4, num_stages=1)
    launched.clear()
    A._launch(_Tuner(), "dq", "grid", (q,), dict(meta, G_P=512), A.KernelOptions())  # rows below one token a tile
    assert launched[0][2]["BLOCK_M"] == 512  # prune_rows widens the tile to the group, as for the table path
    # a row's variant flags (a fifth element) reach the kernel as constexprs; a row without has none
    monkeypatch.setitem(C.HOPPER_PICKS, ("dkdv", 64, False), (64, 128, 8, 1))
    launched.clear()
    A._launch(_Tuner(), "dkdv", "grid", (q,), meta, A.KernelOptions())
    assert launched[0][2] == dict(meta, BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=1)


def test_a_tma_pick_runs_only_on_tensors_tma_can_read(monkeypatch):
    """A HOPPER_PICKS row with ``TMA`` reaches the dK/dV kernel as TMA=True only where the tensors its descriptors read
    qualify (polyrl.backends.cuda.tma.tma_loadable); otherwise the same config runs its pointer loads."""
    import polyrl.backends.cuda.attention as A
    from polyrl.backends.cuda.kernels import configs as C

    monkeypatch.setattr(C, "interpreting", lambda: False)
    monkeypatch.delenv("POLYRL_TRITON_AUTOTUNE", raising=False)
    monkeypatch.setattr(A, "_capability", lambda device: (9, 0))
    monkeypatch.setitem(C.HOPPER_PICKS, ("dkdv", 64, False), (64, 64, 4, 2, {"TMA": True}))
    launched = []

    class _Fn:
        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append(kw)

    class _Tuner:
        fn = _Fn()

    meta = dict(D=64, DV=64, G_P=8, HAS_WINDOW=False, BAND=False)
    q = torch.zeros(1)
    good, bad = torch.zeros(64, 8, 64, dtype=torch.bfloat16), torch.zeros(64, 8, 64, dtype=torch.bfloat16)[:, :, 1:]
    A._launch(_Tuner(), "dkdv", "grid", (q,), meta, A.KernelOptions(), tma_tensors=(good, good))
    A._launch(_Tuner(), "dkdv", "grid", (q,), meta, A.KernelOptions(), tma_tensors=(good, bad))
    A._launch(_Tuner(), "dkdv", "grid", (q,), meta, A.KernelOptions())  # not said: pointer loads
    assert [kw["TMA"] for kw in launched] == [True, False, False]
    assert all(kw["BLOCK_M"] == 64 and kw["num_stages"] == 2 for kw in launched)


def test_tma_loadable_follows_the_hardware_rules():
    from polyrl.backends.cuda.tma import tma_loadable

    x = torch.zeros(64, 8, 64, dtype=torch.bfloat16)
    assert tma_loadable(x, x[:, :4])  # a head slice keeps 16-byte strides and base
    flat = torch.zeros(64 * 8 * 64 + 8, dtype=torch.bfloat16)
    assert tma_loadable(flat[8:].view(64, 8, 64))
    assert not tma_loadable(flat[1:1 + 64 * 8 * 64].view(64, 8, 64))  # good strides, base 2 bytes off
    assert not tma_loadable(x.transpose(1, 2))  # last stride not 1
    assert not tma_loadable(torch.zeros(64, 8, 4, dtype=torch.bfloat16)[:, :, :3])  # row stride 4 elements = 8 B
    assert not tma_loadable(torch.zeros(64, 8, 12, dtype=torch.bfloat16))  # head stride 24 B
    assert tma_loadable(torch.zeros(64, 8, 4, dtype=torch.float32))  # 16 B head stride in fp32
    assert not tma_loadable(torch.zeros(64, 8, 64, dtype=torch.bfloat16)[:, :, :4])  # good strides, 8-byte rows
