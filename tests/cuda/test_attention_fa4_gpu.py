"""The cuda backend's FlashAttention-4 path on a real GPU: bf16 against the fp64 oracle (forward and every gradient,
dsinks included) on GPT-OSS-like shapes, the rule picking FA4 for causal and Triton for window layers, and the
deterministic backward. Skipped cleanly without CUDA, without flash_attn.cute, or on GPUs other than compute
capability 9.x / 10.x. Run on one H100 with flash-attn-4 4.0.0b36 (2026-12-06): every case passed but FA4
at window 1 with sinks on the ragged shape (below)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from cuda_attention_cases import make_case, run_both

from polyrl.core.tolerances import check_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True, scope="module")
def _fa4_ready():
    """Skip unless FA4 can run here; checked when the first test runs, not at collection (the CuTe DSL import
    takes seconds, and ``-m "not gpu"`` runs should not pay it)."""
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("the FA4 path runs on compute capability 9.x / 10.x")
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("needs flash_attn.cute (pip install 'polyrl[fa4]')")
    from polyrl.backends.cuda.attention_choice import _fa4_import

    fn, problem = _fa4_import()
    if fn is None:
        pytest.skip(problem)


GPT_OSS = ([1536, 2560], 64, 8, 64, 64)  # two packed documents, 64 q / 8 kv heads, head dim 64
RAGGED = ([300, 1, 77, 513, 129], 8, 2, 64, 64)  # a one-token document, G = 4


def _fa4():
    from polyrl.backends.cuda.fa4 import fa4_varlen_attention

    return fa4_varlen_attention


def _check(got: dict, want: dict, label: str) -> None:
    errors = {}
    for name in got:
        kind = "attention.forward" if name == "out" else "attention.dsinks" if name == "dsinks" else "attention.grad"
        errors[name] = check_close(kind, got[name], want[name], torch.bfloat16)
    print(label, {n: f"{e[0]:.2e}" for n, e in errors.items()})
    bad = {n: f"{e[0]:.2e} > {e[1]:.0e}" for n, e in errors.items() if not e[2]}
    assert not bad, f"{label}: relative errors over the bar: {bad}"


# FA4 (4.0.0b36) at window 1 with sinks on the ragged shape: dQ / dK 7.10e-3 / 7.09e-3 against the 6.8e-3 bar on
# one H100 (2026-12-06; the GPT-OSS shape at window 1: 5.4e-3, every other case <= 2.6e-3). Each query then sees
# its own key and the sink only, so dS = P (dP - D) is the difference of two nearly equal terms and FA4's bf16
# rounding of P and dS shows; polyrl's own bar is not widened for a peer kernel. polyrl never sends a window layer
# to FA4 unless forced (POLYRL_CUDA_ATTENTION=fa4 / window=fa4), and GPT-OSS's window is 128.
_FA4_WINDOW1 = pytest.mark.xfail(reason="FA4's dQ / dK at window 1 with sinks measured 7.1e-3 against the 6.8e-3 "
                                        "bar (H100); a window layer runs Triton unless FA4 is forced", strict=False)


@pytest.mark.parametrize("window", [None, 128, pytest.param(1, id="1")])
@pytest.mark.parametrize(("shape", "sink"), [(GPT_OSS, True), (RAGGED, True), (RAGGED, False)])
def test_gpu_fa4_matches_fp64_oracle(shape, sink, window, request):
    if window == 1 and sink and shape is RAGGED:
        request.applymarker(_FA4_WINDOW1)
    lengths, hq, hkv, d, dv = shape
    case = make_case(lengths, hq, hkv, d, dv, torch.bfloat16, sink, seed=hq + len(lengths) + (window or 0),
                     device="cuda")
    got, want = run_both(_fa4(), *case, window=window)
    assert got["out"].dtype == torch.bfloat16 and got["out"].shape == (sum(lengths), hq, dv)
    _check(got, want, f"fa4 {lengths} window {window} sink {sink}")


def test_gpu_fa4_mla_head_dims_forced(monkeypatch):
    # DeepSeek MLA's 192 / 128: the rule keeps Triton (not measured), POLYRL_CUDA_ATTENTION=fa4 runs FA4.
    from polyrl.backends.cuda.attention import cuda_varlen_attention
    from polyrl.backends.cuda.attention_choice import clear_caches

    monkeypatch.setenv("POLYRL_CUDA_ATTENTION", "fa4")
    clear_caches()
    try:
        case = make_case([300, 1, 200], 16, 16, 192, 128, torch.bfloat16, False, seed=3, device="cuda")
        got, want = run_both(cuda_varlen_attention, *case, window=None)
        _check(got, want, "fa4 forced, 192 / 128")
    finally:
        clear_caches()


def test_gpu_rule_picks_fa4_for_causal_and_triton_for_window(monkeypatch):
    from polyrl.backends.cuda.attention import cuda_varlen_attention, triton_varlen_attention
    from polyrl.backends.cuda.attention_choice import choose, clear_caches

    monkeypatch.delenv("POLYRL_CUDA_ATTENTION", raising=False)
    clear_caches()
    q, k, v, sinks, cu, _ = make_case(*GPT_OSS, torch.bfloat16, True, seed=5, device="cuda")
    assert choose(q, v, None, sinks).kernel == "fa4"
    assert choose(q, v, 128, sinks).kernel == "triton"
    scale = 64**-0.5
    with torch.no_grad():
        assert torch.equal(cuda_varlen_attention(q, k, v, cu, scale=scale, window=None, sinks=sinks),
                           _fa4()(q, k, v, cu, scale=scale, window=None, sinks=sinks))
        assert torch.equal(cuda_varlen_attention(q, k, v, cu, scale=scale, window=128, sinks=sinks),
                           triton_varlen_attention(q, k, v, cu, scale=scale, window=128, sinks=sinks))


@pytest.mark.parametrize("window", [None, 128])
def test_gpu_fa4_backward_is_deterministic_by_default(window):
    case = make_case(*GPT_OSS, torch.bfloat16, True, seed=11, device="cuda")
    first, want = run_both(_fa4(), *case, window=window)
    second, _ = run_both(_fa4(), *case, window=window)
    for name in first:
        assert torch.equal(first[name], second[name]), f"{name} is not bitwise reproducible"
    _check(first, want, f"fa4 deterministic window {window}")


def test_gpu_backend_dispatch_runs_fa4_on_causal_layers():
    from polyrl.backends.cuda.attention_choice import clear_caches
    from polyrl.core.attention import varlen_attention

    clear_caches()
    q, k, v, sinks, cu, _ = make_case([256, 256], 8, 2, 64, 64, torch.bfloat16, True, seed=1, device="cuda")
    with torch.no_grad():
        out = varlen_attention(q, k, v, cu, window=None, sinks=sinks, backend="cuda")
        ref = _fa4()(q, k, v, cu, scale=64**-0.5, window=None, sinks=sinks)
    assert torch.equal(out, ref)
