"""bench/launch_tail.py: the list-schedule model behind the dK/dV kernel's launch order (HEADS_INNER)."""

from __future__ import annotations

import pytest
from bench_scripts import load_bench


def test_schedule_is_exact_on_small_cases():
    bench = load_bench("launch_tail")
    # equal work: no tail; one heavy program started last runs on alone
    assert bench.finish_time(list(range(4)), {i: 1.0 for i in range(4)}, 2) == 2.0
    assert bench.finish_time([0, 1, 2], {0: 1.0, 1: 1.0, 2: 3.0}, 2) == 4.0
    assert bench.finish_time([2, 0, 1], {0: 1.0, 1: 1.0, 2: 3.0}, 2) == 3.0


def test_the_launch_orders_remove_the_tails_of_equal_documents(capsys):
    bench = load_bench("launch_tail")
    outer = bench.tail("4x4096", "dkdv", "default")
    inner = bench.tail("4x4096", "dkdv", "heads-inner")
    assert outer > 1.10 and inner < 1.01, (outer, inner)
    light, heavy = bench.tail("4x4096", "fwd", "default"), bench.tail("4x4096", "fwd", "heavy-first")
    assert light > 1.02 and heavy < 1.01, (light, heavy)
    with pytest.raises(ValueError, match="heads-inner"):
        bench.tail("4x4096", "dkdv", "heavy-first")
    assert bench.main(["--layouts", "2x1024"]) == 0
    assert "dkdv-n128 heads-inner" in capsys.readouterr().out
