"""bench/experts_path.py's candidate bias gradients, on the CPU: the segmented sum over the expert-sorted rows must
give polyrl's gradients bit for bit where polyrl's CPU runs pin deterministic algorithms (``index_add_``: the
same rows added in the same order), empty experts included; the one-hot matmul agrees to float32 rounding."""

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
def test_segment_bias_gradient_is_polyrls_bit_for_bit_and_one_hot_close(deterministic, dtype):
    bench = load_bench("experts_path")
    config, module = _experts("gpt_oss_tiny")
    case = _case(config, module, 2, tokens=5)
    case[1] = torch.tensor([[0, 2], [3, 0], [2, 3], [0, 3], [2, 0]])  # expert 1 of 4 gets no row
    ours = _run(E.grouped_experts, module, case, dtype)
    segment = _with_gathers(bench.segment_bias_gathers(), module, case, dtype)
    onehot = _with_gathers(bench.onehot_bias_gathers(), module, case, dtype)
    assert len(segment) == len(ours) and all(torch.equal(a, b) for a, b in zip(segment, ours))
    names = ["out", "d hidden", "d weights", *(n for n, _ in module.named_parameters())]
    for name, a, b in zip(names, onehot, ours):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6), name


def test_the_rows_flag_always_keeps_the_two_rows_the_ratios_need():
    bench = load_bench("experts_path")
    assert set(bench.ROWS) == {"polyrl", "grouped_mm", "onehot", "segment"}
    assert [bench.ROWS[k][1] for k in ("onehot", "segment")] == ["polyrl", "polyrl"]
    assert bench.row_keys(["segment"]) == ["polyrl", "grouped_mm", "segment"]
    assert bench.row_keys(["onehot", "grouped_mm", "polyrl"]) == ["polyrl", "grouped_mm", "onehot"]
