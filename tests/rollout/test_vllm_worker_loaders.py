"""The fallback loading path (``vllm_worker.load_direct``, builds without vLLM's recorded checkpoint-format
metadata) on a model whose post-load processing replaced its fused experts' tensors, as vllm-ascend's fused MoE
does from v0.14 (``w13_weight``/``w2_weight`` become new ``Parameter`` objects without ``weight_loader``): the
layer's own loader is put back before the model's ``load_weights``, and nothing else gets one."""

from __future__ import annotations

import torch

from polyrl.backends import vllm_worker as W


class _FusedExperts(torch.nn.Module):
    """A fused-MoE layer as vLLM builds it: [E, 2I, H] / [E, H, I] tensors filled per expert by its loader."""

    def __init__(self, experts: int = 3, hidden: int = 4, inter: int = 2) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(experts, 2 * inter, hidden), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(experts, hidden, inter), requires_grad=False)
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.nn.Parameter, loaded: torch.Tensor, expert_id: int) -> None:
        param.data[expert_id].copy_(loaded)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = _FusedExperts()
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # repacked elsewhere (oneDNN)

    def load_weights(self, weights) -> None:  # vLLM's models: an expert's tensor through its loader, by index
        params = dict(self.named_parameters())
        for name, tensor in weights:
            base, expert = name.rsplit(".", 1)
            param = params[base]
            param.weight_loader(param, tensor, int(expert))


class _Worker:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def get_model(self) -> torch.nn.Module:
        return self.model


def _replace_experts_as_the_processing_does(model: _Model) -> None:
    e = model.experts
    e.w13_weight = torch.nn.Parameter(e.w13_weight.data.clone(), requires_grad=False)  # no weight_loader now
    e.w2_weight = torch.nn.Parameter(e.w2_weight.data.clone(), requires_grad=False)


def test_the_fused_experts_loader_is_put_back_before_a_direct_load() -> None:
    model = _Model()
    _replace_experts_as_the_processing_does(model)
    assert not hasattr(model.experts.w13_weight, "weight_loader")
    new = torch.randn(4, 2)
    W.load_direct(_Worker(model), [("experts.w13_weight.1", torch.randn(4, 4)), ("experts.w2_weight.2", new)])
    torch.testing.assert_close(model.experts.w2_weight[2], new, rtol=0, atol=0)
    assert model.experts.w2_weight[0].abs().sum() == 0  # only expert 2 was written
    assert not hasattr(model.proj.weight, "weight_loader")  # a repacked linear's placeholder gets no loader


def test_a_loader_still_attached_is_left_as_it_is() -> None:
    model = _Model()
    mine = model.experts.w13_weight.weight_loader
    assert W.reattach_loaders(model) == 0 and model.experts.w13_weight.weight_loader == mine
    _replace_experts_as_the_processing_does(model)
    assert W.reattach_loaders(model) == 2
