"""bench/attention_sweep.py's kernels and variants on the GPU (part of ``bash bench/gpu_check.sh``): every candidate
compiles for the GPU and gives the default config's outputs, among them the dK/dV kernel's PREFETCH and TMA variants, at
GPT-OSS heads (64 query / 8 kv, head dim 64, bf16) on two causal documents."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_bench

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_every_candidate_and_variant_gives_the_defaults_outputs_on_the_gpu():
    mod = load_bench("attention_sweep")
    cands = {"fwd": [(128, 64, 4, 3)], "dq": [(128, 64, 4, 2)],
             "dkdv": [(64, 64, 4, 2), (64, 128, 8, 1), (64, 64, 4, 1), (32, 64, 4, 2)]}

    def once(fn, **_kw):
        fn()
        torch.cuda.synchronize()
        return 1.0

    r = mod.sweep_layout("2x1024", None, do_bench=once, candidates=cands)
    rows = r["kernels"]["dkdv"]["rows"]
    for variant in ("prefetch", "tma"):
        assert [row["config"] for row in rows if row["config"].endswith(variant)] == [
            mod.config_label(c, variant) for c in cands["dkdv"]]
    for row in rows:
        assert row.get("ms") is not None, row  # compiled and ran
        assert row["ok"] and row["max_rel_diff_vs_default"] < 1e-2, row
