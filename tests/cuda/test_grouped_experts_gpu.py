"""polyrl.core.models.experts.grouped_experts on a GPU (part of ``bash bench/gpu_check.sh``): the CPU suite's claims
(tests/models/test_grouped_experts.py) where the experts path runs in training, on CUDA's kernels: the forward is
transformers' ``grouped_mm`` path bit for bit, every gradient is as close to float64 as transformers' own, two
backward passes are bitwise equal, and the gathers' backward launches no ``indexing_backward_kernel``."""

from __future__ import annotations

import experts_cases
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _experts(preset: str):
    return experts_cases.experts(preset, "cuda")


def _case(config, module, k: int, tokens: int):
    return experts_cases.case(config, module, k, tokens, device="cuda")


@pytest.mark.parametrize("preset", ["gpt_oss_tiny", "deepseek_v3_tiny"])
@pytest.mark.parametrize("k", [2, 4])
def test_gpu_forward_is_transformers_bit_for_bit_and_gradients_as_close_to_float64(preset, k):
    from transformers.integrations import moe

    from polyrl.core.models import experts as E

    config, module = _experts(preset)
    case = _case(config, module, k, tokens=300)
    exact = experts_cases.run(moe.batched_mm_experts_forward, module, case, torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        ours = experts_cases.run(E.grouped_experts, module, case, dtype)
        theirs = experts_cases.run(moe.grouped_mm_experts_forward, module, case, dtype)
        assert torch.equal(ours[0], theirs[0]), (dtype, (ours[0] - theirs[0]).abs().max().item())
        for i, (a, b, want) in enumerate(zip(ours, theirs, exact)):
            ours_err = ((a.double() - want).norm() / want.norm()).item()
            theirs_err = ((b.double() - want).norm() / want.norm()).item()
            # as close as transformers' path, up to the other summation order of k > 2 (a few units of rounding)
            assert ours_err <= 1.5 * theirs_err + (1e-6 if dtype == torch.float32 else 4e-3), (
                dtype, i, ours_err, theirs_err)


def test_gpu_backward_is_bitwise_reproducible():
    from polyrl.core.models import experts as E

    config, module = _experts("gpt_oss_tiny")
    case = _case(config, module, 4, tokens=2048)
    first = experts_cases.run(E.grouped_experts, module, case, torch.bfloat16)
    for _ in range(3):
        again = experts_cases.run(E.grouped_experts, module, case, torch.bfloat16)
        assert all(torch.equal(a, b) for a, b in zip(again, first))


def test_gpu_gathers_backward_launches_no_indexing_backward_kernel():
    """The kernel transformers' ``tensor[index]`` backward runs (about 30% of the tiny DAPO recipe's GPU time on an
    H100 on c178864; the two bias gradients' share of it 27.6% on 6f6b711): none here. With torch's deterministic
    algorithms off, as the cuda backend runs, the bias gradients are segmented sums over the expert-sorted rows."""
    assert not torch.are_deterministic_algorithms_enabled()
    from torch.profiler import ProfilerActivity, profile
    from transformers.integrations import moe

    from polyrl.core.models import experts as E

    config, module = _experts("gpt_oss_tiny")
    case = _case(config, module, 4, tokens=512)

    def kernels(fn) -> dict[str, int]:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            experts_cases.run(fn, module, case, torch.bfloat16)
        return {e.key: e.count for e in prof.key_averages()}

    def scatters(counts: dict[str, int]) -> int:
        return sum(n for name, n in counts.items() if "indexing_backward_kernel" in name)

    theirs = scatters(kernels(moe.grouped_mm_experts_forward))
    assert theirs >= 3  # what the test would catch: transformers' path (4 a layer's backward in the H100 profile)
    ours = kernels(E.grouped_experts)
    assert ours.get("RowGatherBackward") == 3 and ours.get("BiasGatherBackward") == 2
    assert scatters(ours) == 0 < theirs
