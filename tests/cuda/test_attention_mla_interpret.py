"""bench/attention_mla.py on CPU under the Triton interpreter, at toy sizes (head dims 24 / 8 keep D != Dv): the
Triton kernel and the backend's slot are timed and checked against the fp32 reference, FA4 not installed is a
skipped row (never a figure), the Measurement line needs both kernels, and bad arguments exit 2."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_bench, wall_ms

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU check")


def test_the_triton_kernel_and_the_slot_run_and_fa4_absent_is_a_skipped_row():
    mod = load_bench("attention_mla")
    rows = mod.measure("2x24", 2, list(mod.IMPLS), device="cpu", dtype=torch.float32, do_bench=wall_ms, d=24, dv=8)
    by = {r["impl"]: r for r in rows}
    assert by["polyrl"]["fwd_ms"] > 0 and by["polyrl"]["fwd_bwd_ms"] > 0 and by["polyrl"]["fwd_bwd_tflops"] > 0
    assert by["polyrl-selected"]["choice"].startswith("triton")  # fp32 on the CPU: never FA4
    for peer in ("fa4", "fa4-direct"):
        assert "fwd_ms" not in by[peer] and ("skipped" in by[peer] or "error" in by[peer])
    # no peer figure, so no ratio and no Measurement row
    assert mod.comparison(rows) == []
    errors = mod.accuracy(2, ["polyrl", "polyrl-selected"], device="cpu", dtype=torch.float32, layout="2x24", d=24,
                          dv=8)
    assert set(errors) == {"polyrl", "polyrl-selected"}
    for err in errors.values():
        assert set(err) == {"out", "dq", "dk", "dv"} and max(err.values()) < 1e-5, err


def test_the_comparison_prints_ours_beside_fa4_and_the_measurement_row():
    mod = load_bench("attention_mla")
    rows = [{"layout": "4x4096", "impl": "polyrl", "fwd_ms": 3.0, "fwd_bwd_ms": 12.0},
            {"layout": "4x4096", "impl": "fa4", "fwd_ms": 2.0, "fwd_bwd_ms": 8.0}]
    lines = mod.comparison(rows)
    assert "ratio 1.50 / 1.50" in lines[0]
    assert lines[-1].strip() == ('Measurement("4x4096", None, (192, 128), triton_ms=(3.000, 12.000), '
                                 'fa4_ms=(2.000, 8.000)),')


def test_useful_flop_counts_visible_pairs():
    mod = load_bench("attention_mla")
    # one document of 2 tokens, one head: 3 visible pairs; forward 2 x (192 + 128) FLOP a pair
    assert mod.useful_tflop("1x2", 1, False) * 1e12 == pytest.approx(3 * 2 * (192 + 128))
    assert mod.useful_tflop("1x2", 1, True) * 1e12 == pytest.approx(3 * (2 * 320 + 2 * 640))


@pytest.mark.parametrize("args, message", [
    (["--impls", "flex"], "unknown implementation(s) flex"),
    (["--layouts", "4by4096"], "--layouts: layout '4by4096'"),
    (["--heads", "0"], "--heads 0: at least 1"),
    ([], "needs a CUDA GPU"),
])
def test_bad_arguments_and_no_gpu_exit_2(args, message, capsys):
    assert load_bench("attention_mla").main(args) == 2
    assert message in capsys.readouterr().err
