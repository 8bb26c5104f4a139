"""bench/fused_loss_chunks.py on the CPU at small shapes: every chunk budget and dW accumulator gives the four-matmul
path's weight gradient, the budgets change the chunk rows, and without a GPU the default device is refused in one
line (exit 2)."""

from __future__ import annotations

import json

import pytest
import torch
from bench_scripts import load_bench


def test_every_setting_gives_the_four_matmul_gradient(tmp_path):
    bench = load_bench("fused_loss_chunks")
    out = tmp_path / "r.json"
    assert bench.main(["--device", "cpu", "--T", "32", "--H", "16", "--V", "300", "--budgets-mib", "0.01", "0.02",
                       "--iters", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    fused = {k: r for k, r in rows.items() if k.startswith("fused loss")}
    assert len(fused) == 4 and len({r["chunk_rows"] for r in fused.values()}) == 2
    assert all(r["grad_w_rel_diff"] <= 1e-5 for r in rows.values()), {k: r["grad_w_rel_diff"] for k, r in rows.items()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_the_gpu_default_is_refused_without_one(capsys):
    assert load_bench("fused_loss_chunks").main(["--iters", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
