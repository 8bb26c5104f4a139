"""The expert-parallel MoE module in one process: with every expert local (no ep group) it computes what
transformers' experts module computes, forward and backward, for GPT-OSS and DeepSeek-V3, whatever experts
implementation transformers runs; the dispatch never drops a row."""

from __future__ import annotations

import copy

import pytest
import torch

from polyrl.backends.cpu import CpuBackend
from polyrl.core.distributed.expert_parallel import ExpertParallelExperts, experts_modules, is_hf_experts
from polyrl.core.models import build_model
from polyrl.core.tolerances import check_close


def _moe_layer(preset: str, impl: str | None) -> torch.nn.Module:
    model = build_model(preset, seed=0, dtype=torch.float32, experts_implementation=impl, backend="cpu")
    layer = model.model.layers[-1].mlp  # DeepSeek-V3 tiny: layer 0 is dense
    with torch.no_grad():  # random, non-zero router and experts (presets init some to zero)
        g = torch.Generator().manual_seed(1)
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return layer


@pytest.mark.parametrize("preset", ["gpt_oss_tiny", "deepseek_v3_tiny"])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_module_equals_transformers_forward_and_backward(preset: str, impl: str) -> None:
    ref = _moe_layer(preset, impl)
    ours = copy.deepcopy(ref)
    [(parent, name, experts)] = experts_modules(ours)
    setattr(parent, name, ExpertParallelExperts(experts, CpuBackend()))
    assert not experts_modules(ours) and isinstance(ours.experts, ExpertParallelExperts)
    # same parameters under the same names: checkpoints and HF export see the same tensors
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    x = torch.randn(3, 7, ref.experts.hidden_size if hasattr(ref.experts, "hidden_size") else 64,
                    generator=torch.Generator().manual_seed(2), requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    out_ref = ref(x)
    out = ours(x2)
    out_ref, out = (o[0] if isinstance(o, tuple) else o for o in (out_ref, out))
    err, bar, ok = check_close("moe.experts", out, out_ref, torch.float32)
    assert ok, f"forward {err} > {bar}"
    assert err < 1e-6  # the same math, summation order only
    (out_ref * torch.linspace(-1, 1, out_ref.numel()).view_as(out_ref)).sum().backward()
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    err, bar, ok = check_close("moe.experts_grad", x2.grad, x.grad, torch.float32)
    assert ok, f"input grad {err} > {bar}"
    for (n, p_ref), (_, p) in zip(ref.named_parameters(), ours.named_parameters()):
        assert p.grad is not None, n
        err, bar, ok = check_close("moe.experts_grad", p.grad, p_ref.grad, torch.float32)
        assert ok, f"{n}: grad {err} > {bar}"


def test_a_wrong_expert_is_caught() -> None:
    """The comparison can fail: swapping two experts' weights changes the output beyond the bar."""
    ref = _moe_layer("gpt_oss_tiny", "eager")
    ours = copy.deepcopy(ref)
    [(parent, name, experts)] = experts_modules(ours)
    with torch.no_grad():
        experts.down_proj[[0, 1]] = experts.down_proj[[1, 0]].clone()
    setattr(parent, name, ExpertParallelExperts(experts, CpuBackend()))
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    _, _, ok = check_close("moe.experts", ours(x)[0], ref(x)[0], torch.float32)
    assert not ok


def test_every_row_dispatched_in_expert_order_and_back() -> None:
    backend = CpuBackend()
    hidden = torch.arange(5 * 2, dtype=torch.float32).view(5, 2)
    ids = torch.tensor([[3, 0], [1, 3], [0, 2], [2, 1], [3, 3]])
    d = backend.expert_dispatch(hidden, ids, num_experts=4)
    assert d.expert_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 3, 3]  # grouped, nothing dropped
    assert d.tokens[:, 0].tolist() == [0, 4, 2, 6, 4, 6, 0, 2, 8, 8]  # token order inside an expert
    w = torch.tensor([[1.0, 2.0]] * 5)
    assert torch.equal(backend.expert_combine(d.tokens, d, w), hidden * 3)


def test_only_fused_experts_modules_are_recognised() -> None:
    layer = _moe_layer("deepseek_v3_tiny", None)
    assert is_hf_experts(layer.experts)
    assert not is_hf_experts(layer.shared_experts) and not is_hf_experts(layer.gate)


def test_expert_parallel_refusals_before_any_process_starts() -> None:
    from polyrl.core.config import ShardingConfig
    from polyrl.core.distributed.sharding import check_sharding
    from polyrl.core.errors import BadInputError

    check_sharding(CpuBackend(), 4, ShardingConfig(expert_parallel=2))
    with pytest.raises(BadInputError, match="must divide the world size"):
        check_sharding(CpuBackend(), 6, ShardingConfig(expert_parallel=4))
    with pytest.raises(BadInputError, match="must divide the world size"):
        check_sharding(CpuBackend(), 1, ShardingConfig(expert_parallel=2))
    with pytest.raises(BadInputError, match=r"sharding\.enabled"):
        check_sharding(CpuBackend(), 2, ShardingConfig(expert_parallel=2, enabled=False))
    with pytest.raises(BadInputError, match=">= 1"):
        check_sharding(CpuBackend(), 2, ShardingConfig(expert_parallel=0))
