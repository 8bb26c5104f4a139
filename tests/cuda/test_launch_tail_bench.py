"""bench/launch_tail.py: the list-schedule model behind the dK/dV kernel's launch order (HEADS_INNER)."""

from __future__ import annotations

from bench_scripts import load_bench


def test_schedule_is_exact_on_small_cases():
    bench = load_bench("launch_tail")
    # equal work: no tail; one heavy program started last runs on alone
    assert bench.finish_time(list(range(4)), {i: 1.0 for i in range(4)}, 2) == 2.0
    assert bench.finish_time([0, 1, 2], {0: 1.0, 1: 1.0, 2: 3.0}, 2) == 4.0
    assert bench.finish_time([2, 0, 1], {0: 1.0, 1: 1.0, 2: 3.0}, 2) == 3.0


def test_heads_inner_removes_the_dkdv_tail_of_equal_documents(capsys):
    bench = load_bench("launch_tail")
    outer = bench.tail("4x4096", "dkdv", "heads-outer")
    inner = bench.tail("4x4096", "dkdv", "heads-inner")
    assert outer > 1.10 and inner < 1.01, (outer, inner)
    assert bench.tail("4x4096", "fwd", "heads-outer") < 1.01  # heaviest-first q tiles leave no tail
    assert bench.main(["--layouts", "2x1024"]) == 0
    assert "dkdv-n128 heads-inner" in capsys.readouterr().out
