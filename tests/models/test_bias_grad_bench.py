"""bench/bias_grad.py on the CPU at the tiny shapes: every exact row (index_put_, index_add_, segment_reduce) equals
polyrl's bias gradient bit for bit, the one-hot matmul only to float32 rounding, and the JSON holds every row."""

from __future__ import annotations

import json

import torch
from bench_scripts import load_bench


def test_the_exact_sums_equal_polyrls_bit_for_bit(tmp_path):
    bench = load_bench("bias_grad")
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        argv = ["--device", "cpu", "--shapes", "tiny", "--reps", "1", "--out", str(tmp_path / "b.json")]
        assert bench.main(argv) == 0
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    results = json.loads((tmp_path / "b.json").read_text())["results"]
    assert [(r["rows"], r["width"], r["experts"]) for r in results] == bench.SHAPES["tiny"]
    for r in results:
        assert all(r[k]["equal_to_polyrl"] for k in ("index_put", "index_add_det", "segment")), r
        assert 0 < r["onehot"]["max_abs_diff"] < 1e-3 and all(r[k]["ms"] > 0 for k in bench._sums(4))
