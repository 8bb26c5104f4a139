"""bench/experts_path.py's candidate bias gradient, on the CPU: the one-hot matmul agrees with polyrl's bias gradient
to float32 rounding, an empty expert included; the --rows flag keeps the rows the ratios need."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_bench
from experts_cases import case as _case
from experts_cases import experts as _experts
from experts_cases import run as _run

from polyrl.core.models import experts as E


def _with_gathers(gathers, module, case, dtype):
    E._GATHERS = gathers
    try:
        return _run(E.grouped_experts, module, case, dtype)
    finally:
        E._GATHERS = None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_hot_bias_gradient_is_close_to_polyrls(deterministic, dtype):
    bench = load_bench("experts_path")
    config, module = _experts("gpt_oss_tiny")
    case = _case(config, module, 2, tokens=5)
    case[1] = torch.tensor([[0, 2], [3, 0], [2, 3], [0, 3], [2, 0]])  # expert 1 of 4 gets no row
    ours = _run(E.grouped_experts, module, case, dtype)
    onehot = _with_gathers(bench.onehot_bias_gathers(), module, case, dtype)
    assert len(onehot) == len(ours) >= 5
    names = ["out", "d hidden", "d weights", *(n for n, _ in module.named_parameters())]
    for name, a, b in zip(names, onehot, ours):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6), name


def test_the_rows_flag_always_keeps_the_two_rows_the_ratios_need():
    bench = load_bench("experts_path")
    assert set(bench.ROWS) == {"polyrl", "grouped_mm", "onehot"}
    assert bench.ROWS["onehot"][1] == "polyrl"
    assert bench.row_keys(["onehot"]) == ["polyrl", "grouped_mm", "onehot"]
    assert bench.row_keys(["onehot", "grouped_mm", "polyrl"]) == ["polyrl", "grouped_mm", "onehot"]
