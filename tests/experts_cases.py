"""One experts module of a tiny preset, a routed input and a run of an experts function with every gradient:
shared by the CPU tests of grouped_experts (tests/models/test_grouped_experts.py) and their GPU form
(tests/cuda/test_grouped_experts_gpu.py)."""

from __future__ import annotations

import copy

import torch


def experts(preset: str, device: str = "cpu"):
    """(config, the first experts module of ``preset``'s tiny model) on ``device``."""
    from polyrl.core.models import build_model
    from polyrl.core.plugins import list_backends

    model = build_model(preset, vocab_size=32, seed=0, backend=list_backends()["cpu"])
    module = next(m for m in model.modules() if hasattr(m, "down_proj") and hasattr(m, "num_experts"))
    return model.config, module.to(device)


def case(config, module, k: int, tokens: int = 37, seed: int = 1, device: str = "cpu"):
    """hidden states, top-k expert ids, routing weights and an upstream gradient, drawn on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, config.hidden_size, generator=gen)
    top_k_index = torch.rand(tokens, module.num_experts, generator=gen).topk(k, dim=-1).indices
    top_k_weights = torch.rand(tokens, k, generator=gen).softmax(-1)
    d_out = torch.randn(tokens, config.hidden_size, generator=gen)
    return [x.to(device) for x in (hidden, top_k_index, top_k_weights, d_out)]


def run(fn, module, case, dtype):
    """Output, d hidden, d routing weights and every parameter's gradient."""
    hidden, top_k_index, top_k_weights, d_out = case
    module = copy.deepcopy(module).to(dtype)
    h = hidden.detach().to(dtype).clone().requires_grad_()
    w = top_k_weights.detach().to(dtype).clone().requires_grad_()
    out = fn(module, h, top_k_index, w)
    out.backward(d_out.to(dtype))
    return [out.detach(), h.grad, w.grad, *(p.grad for p in module.parameters())]
