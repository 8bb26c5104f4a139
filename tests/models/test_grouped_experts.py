"""polyrl.core.models.experts.grouped_experts: transformers' grouped_mm experts path with gathers whose backward does
not scatter. Same forward bit for bit; with k = 2 (the tiny presets) the same gradients bit for bit in float32;
every gradient against float64; deterministic; transformers' own expert parallelism runs transformers' function."""

from __future__ import annotations

import copy

import pytest
import torch
from experts_cases import case as _case
from experts_cases import experts as _experts
from experts_cases import run as _run
from transformers.integrations import moe

from polyrl.core.models import experts as E


@pytest.mark.parametrize("preset", ["gpt_oss_tiny", "deepseek_v3_tiny"])
def test_float32_matches_transformers_bit_for_bit_with_two_experts_a_token(preset, deterministic):
    config, module = _experts(preset)
    assert config.num_experts_per_tok == 2
    case = _case(config, module, 2)
    ours = _run(E.grouped_experts, module, case, torch.float32)
    theirs = _run(moe.grouped_mm_experts_forward, module, case, torch.float32)
    assert len(ours) == len(theirs) >= 5
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("preset", ["gpt_oss_tiny", "deepseek_v3_tiny"])
@pytest.mark.parametrize("k", [2, 3])
def test_every_gradient_against_float64(preset, k):
    """float32 and bfloat16 against float64 (transformers' batched_mm path: torch has no float64 grouped matmul).
    The bf16 bias gradients are summed in float32, closer to exact than transformers' bf16 accumulation."""
    config, module = _experts(preset)
    case = _case(config, module, k)
    exact = _run(moe.batched_mm_experts_forward, module, case, torch.float64)
    for dtype, bar in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        for got, want in zip(_run(E.grouped_experts, module, case, dtype), exact):
            err = ((got.double() - want).norm() / want.norm()).item()
            assert err < bar, (dtype, err)


def test_the_same_numbers_on_every_call(deterministic):
    config, module = _experts("gpt_oss_tiny")
    case = _case(config, module, 2, tokens=300)
    first = _run(E.grouped_experts, module, case, torch.bfloat16)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(_run(E.grouped_experts, module, case, torch.bfloat16), first))


def _ops(fn) -> dict[str, int]:
    """How many times each aten op ran in one forward + backward of ``fn`` on the gpt_oss_tiny experts."""
    from torch.profiler import profile

    config, module = _experts("gpt_oss_tiny")
    case = _case(config, module, 2)
    with profile() as prof:
        _run(fn, module, case, torch.float32)
    counts = {e.key: e.count for e in prof.key_averages()}
    if fn is E.grouped_experts:
        assert counts.get("RowGatherBackward") == 3 and counts.get("BiasGatherBackward") == 2
    return counts


@pytest.mark.parametrize("deterministic_mode", [True, False])
def test_no_index_put_in_the_backward(deterministic_mode):
    """The token rows, the routing weights and the un-sort differentiate by gathers; the two biases by
    ``index_add_`` under deterministic algorithms (polyrl's CPU runs), else by segmented sums over the
    expert-sorted rows. No ``index_put_`` (the scatter behind ``tensor[index]``'s backward, five of them in
    transformers' path) either way."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(deterministic_mode, warn_only=True)
    try:
        ours = _ops(E.grouped_experts)
        assert ours.get("aten::_index_put_impl_", 0) == 0
        assert ours.get("aten::index_add_", 0) == (2 if deterministic_mode else 0)
        assert ours.get("aten::segment_reduce", 0) == (0 if deterministic_mode else 2)
        # what the test would have caught: transformers' five backward scatters and its forward's inverse permutation
        assert _ops(moe.grouped_mm_experts_forward).get("aten::_index_put_impl_", 0) == 6
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_segmented_sum_is_index_adds_bit_for_bit_with_an_empty_expert(dtype):
    """BiasGather's segmented sum (deterministic algorithms off) against ``index_add_``'s serial loop in the same
    float32 (float64) buffer: the same rows added in the same order, so the same bits; experts 1 and 4 get no rows
    (a zero gradient)."""
    assert not torch.are_deterministic_algorithms_enabled()
    _, bias_gather = E._gathers()
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(6, 5, generator=gen).to(dtype).requires_grad_()
    ids = torch.tensor([0, 0, 2, 2, 2, 3, 5, 5])
    grad = torch.randn(ids.numel(), 5, generator=gen).to(dtype)
    bias_gather.apply(bias, ids, E.expert_ends(ids, 6)).backward(grad)
    acc = torch.promote_types(dtype, torch.float32)
    want = torch.zeros(6, 5, dtype=acc).index_add_(0, ids, grad.to(acc)).to(dtype)
    assert torch.equal(bias.grad, want)
    assert not bias.grad[[1, 4]].any() and bias.grad[[0, 2, 3, 5]].abs().sum(dim=1).gt(0).all()


def test_without_a_segment_reduce_kernel_the_bias_gradient_falls_back(monkeypatch):
    """A device whose torch raises NotImplementedError for segment_reduce gets ``index_put_(accumulate=True)``: the
    same gradients, bit for bit here (the CPU's index_put_ adds serially below 32,768 elements)."""
    assert not torch.are_deterministic_algorithms_enabled()
    config, module = _experts("gpt_oss_tiny")
    case = _case(config, module, 2)
    want = _run(E.grouped_experts, module, case, torch.float32)
    calls = []

    def no_kernel(*args, **kwargs):
        calls.append(1)
        raise NotImplementedError("segment_reduce: no kernel for this device")

    monkeypatch.setattr(torch, "segment_reduce", no_kernel)
    got = _run(E.grouped_experts, module, case, torch.float32)
    assert len(calls) == 2  # both bias gradients tried it, then fell back
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_without_grad_the_plain_gathers_run():
    config, module = _experts("gpt_oss_tiny")
    hidden, top_k_index, top_k_weights, _ = _case(config, module, 2)
    with torch.no_grad():
        ours = E.grouped_experts(module, hidden, top_k_index, top_k_weights)
        theirs = moe.grouped_mm_experts_forward(module, hidden, top_k_index, top_k_weights)
    assert torch.equal(ours, theirs) and ours.grad_fn is None


def test_transformers_expert_parallel_modules_run_its_own_function(monkeypatch):
    config, module = _experts("gpt_oss_tiny")
    hidden, top_k_index, top_k_weights, _ = _case(config, module, 2)
    calls = []
    real = moe.grouped_mm_experts_forward
    monkeypatch.setattr(moe, "grouped_mm_experts_forward", lambda *a: calls.append(1) or real(*a))
    module = copy.deepcopy(module)
    module._is_expert_parallel = False
    E.grouped_experts(module, hidden, top_k_index, top_k_weights)
    assert calls == []
    module._is_expert_parallel = True
    E.grouped_experts(module, hidden, top_k_index, top_k_weights)
    assert calls == [1]
