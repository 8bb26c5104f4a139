"""MoE experts on Ascend: ``torch_npu.npu_grouped_matmul`` forward, with the backward op-plugin does not have.

transformers' default experts path calls ``torch._grouped_mm`` (``torch.nn.functional.grouped_mm``), which
op-plugin does not register for the NPU (it registers ``_scaled_grouped_mm`` only). The grouped matmul that exists
there is ``npu_grouped_matmul`` (MindSpeed-LLM's GPT-OSS uses it), and op-plugin gives it no autograd formula, so
:class:`GroupedMatmul` writes the backward with documented ops only:

- forward   ``y = x @ w_e`` per expert group of rows: ``npu_grouped_matmul`` with ``group_type=0`` (groups along
  M), x [S, K] and one weight tensor [E, K, N] (a transposed view of [E, N, K] is accepted: DeepSeek's weights are
  stored [E, out, in]), ``group_list`` = rows per expert (``group_list_type=1``), ``split_item=3`` (one output
  tensor [S, N]) — the "单单单" row of op-plugin ``docs/context/torch_npu-npu_grouped_matmul.md``@7.3.0;
- ``dx = dy @ w_e^T``: the same call on dy with the weight's transposed view;
- ``dw_e = x_e^T @ dy_e``: ``npu_grouped_matmul_add_(dw, x, dy, group_list, transpose_x=True, group_type=2)``
  into a float32 zero [E * K, N] (op-plugin ``op_plugin_functions.yaml``@7.3.0; its only test,
  ``test/test_custom_ops/test_npu_grouped_matmul_add.py``, runs exactly this case; CANN's ``grouped_matmul_add``
  takes float16 / bfloat16 x and weight with a float32 y). Its ``group_list`` is cumulative (the 7.x schema has
  no ``group_list_type``). ``npu_grouped_matmul(group_type=2)`` with a transposed x, which an earlier polyrl
  called, is not a case the page lists for Atlas A2/A3. float32 experts (parity runs) have no such op: their
  weight gradient is one ``torch.mm`` per expert. An expert with no rows gets a zero gradient whatever the op
  writes there.

Biases (GPT-OSS) are added outside the op, gathered per row: op-plugin wants float32 biases beside bfloat16
inputs, and a plain gather-add needs no such rule. The routing around the matmuls (sort rows by expert, gate,
weight by the router, sum over top-k) is transformers' ``grouped_mm`` path step for step, so the numbers are the
reference's up to the matmuls' summation order. Checked against the documented API on the CPU emulator only
(polyrl.emulation.npu), never on an NPU here.
"""

from __future__ import annotations

from typing import Any

import torch


class GroupedMatmul(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ w[e]`` for rows sorted by expert, ``counts[e]`` rows each."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        import torch_npu

        ctx.save_for_backward(x, w, counts)
        return torch_npu.npu_grouped_matmul([x], [w], group_list=counts, split_item=3, group_type=0,
                                            group_list_type=1)[0]

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        import torch_npu

        x, w, counts = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch_npu.npu_grouped_matmul([dy], [w.transpose(-2, -1)], group_list=counts, split_item=3,
                                              group_type=0, group_list_type=1)[0]
        if ctx.needs_input_grad[1]:
            dw = weight_grad(x, dy, counts, w.shape).to(w.dtype)
            dw = torch.where((counts > 0)[:, None, None], dw, torch.zeros((), dtype=dw.dtype, device=dw.device))
        return dx, dw, None


def weight_grad(x: torch.Tensor, dy: torch.Tensor, counts: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``dw[e] = x[rows of e]^T @ dy[rows of e]`` in float32, [E, K, N] = ``shape``; x [S, K], dy [S, N] sorted by
    expert, ``counts[e]`` rows each."""
    experts, k, n = shape
    if x.dtype in (torch.float16, torch.bfloat16):
        import torch_npu

        dw = torch.zeros(experts * k, n, dtype=torch.float32, device=x.device)
        torch_npu.npu_grouped_matmul_add_(dw, x, dy.to(x.dtype), torch.cumsum(counts, 0), transpose_x=True,
                                          transpose_weight=False, group_type=2)
        return dw.view(experts, k, n)
    # float32: the op takes float16 / bfloat16 only; one matmul per expert (the counts read once, on the host)
    dw = torch.zeros(experts, k, n, dtype=torch.float32, device=x.device)
    start = 0
    for e, rows in enumerate(counts.tolist()):
        if rows:
            dw[e] = x[start:start + rows].float().t() @ dy[start:start + rows].float()
        start += rows
    return dw


def _linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor | None,
            is_transposed: bool) -> torch.Tensor:
    # weight: [E, in, out] when is_transposed (GPT-OSS), else [E, out, in] (DeepSeek): the op takes [E, K, N]
    out = GroupedMatmul.apply(x.contiguous(), weight if is_transposed else weight.transpose(-2, -1), counts)
    return out if bias is None else out + bias


def npu_experts(module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts kernel of the ascend backend (contract: polyrl.core.models.experts)."""
    if getattr(module, "_is_expert_parallel", False):
        raise NotImplementedError("ascend experts: transformers' expert parallelism is not supported")
    num_experts = module.num_experts
    num_tokens, hidden_dim = hidden_states.shape
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)  # (S,) S = tokens x top_k
    sample_weights = top_k_weights.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids, stable=True)
    x = hidden_states[perm // top_k]  # (S, H), rows grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=expert_ids.device)
    counts.scatter_add_(0, expert_ids_g, torch.ones_like(expert_ids_g, dtype=torch.int64))
    has_bias = getattr(module, "has_bias", False)
    if getattr(module, "has_gate", True):
        up, up_bias = module.gate_up_proj, (module.gate_up_proj_bias[expert_ids_g] if has_bias else None)
    else:
        up, up_bias = module.up_proj, (module.up_proj_bias[expert_ids_g] if has_bias else None)
    transposed = getattr(module, "is_transposed", False)
    h = _linear(x, up, counts, up_bias, transposed)
    h = module._apply_gate(h) if getattr(module, "has_gate", True) else module.act_fn(h)
    down_bias = module.down_proj_bias[expert_ids_g] if has_bias else None
    out = _linear(h, module.down_proj, counts, down_bias, transposed) * sample_weights[perm].unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    # back to (token, k) order and a sum over k, as transformers does (deterministic, no index_add)
    return out[inv].view(num_tokens, top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)
