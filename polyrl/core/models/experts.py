"""The transformers experts implementation ``"polyrl"``: MoE experts run the kernel of the model's backend.

transformers runs the experts of its MoE models (GPT-OSS, DeepSeek-V3, Qwen-MoE, ...) through a named
implementation (``config._experts_implementation``: ``grouped_mm``, its default where torch has it;
``batched_mm``; ``eager``). Not every device has what the default needs: torch_npu registers no
``torch._grouped_mm`` for the NPU. So, as for attention, ``build_model`` builds models with ``"polyrl"``, whose
forward hands the experts module to the backend bound to the model (polyrl.core.attention.hf.bind_backend):
``Backend.experts`` runs the backend's ``experts_kernel`` — the reference below, or a backend's own (the ascend
backend: ``npu_grouped_matmul``). Rebinding a model to another backend switches its experts with its attention.

Contract of an experts kernel ``fn(module, hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) ->
[T, H]`` in hidden_states' dtype: the forward of transformers' experts module ``module`` (its fused 3-D
weights ``gate_up_proj`` / ``up_proj`` and ``down_proj``, optional biases, ``_apply_gate`` / ``act_fn``, and the
layout flags ``is_transposed``, ``has_gate``, ``has_bias`` that transformers' ``use_experts_implementation`` sets),
differentiable in the weights and the inputs.

:func:`running_backend` names the backend whose experts kernel is running (a context variable), so that an
emulator can refuse what the emulated device lacks only for that backend's kernels (polyrl.emulation.npu).
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

NAME = "polyrl"
_running: contextvars.ContextVar[str | None] = contextvars.ContextVar("polyrl_experts_backend", default=None)


def running_backend() -> str | None:
    """The name of the backend whose experts kernel is running in this context, None outside one."""
    return _running.get()


def polyrl_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward for ``"polyrl"``: the bound backend's ``experts`` (``default_backend()`` for
    a model never bound, as for attention)."""
    from polyrl.core.attention.hf import bound_backend

    backend = bound_backend(module)
    if backend is None:
        from polyrl.core.plugins.selection import default_backend

        backend = default_backend()
    token = _running.set(backend.name)
    try:
        return backend.experts(module, hidden_states, top_k_index, top_k_weights)
    finally:
        _running.reset(token)


# Inside a static decode step that is to be captured (rollout.decode: graph; polyrl.core.rollout.static_decode),
# float32 experts run transformers' batched_mm path when its gathered weights stay under this many bytes: torch has
# no float32 grouped matmul on CUDA, and the fallback reads the expert offsets on the host, which a captured graph
# cannot do (measured on an H100). An uncaptured static step keeps the grouped path: on 2 CPU cores batched_mm made
# the tiny recipe's generate call 2.2x slower (bench/decode_graph.py).
STATIC_BATCHED_MAX_BYTES = 1 << 30


def _static_step_batched(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> bool:
    """Run the batched_mm path (no data-dependent shapes, no host reads)? Only inside a static decode step that is
    to be captured (``StaticDecodeMasks.capturable``), for float32, and while the per-(token, expert) weight copies
    it gathers stay under STATIC_BATCHED_MAX_BYTES."""
    import torch

    from polyrl.core.attention.hf import static_decode_masks

    masks = static_decode_masks()
    if masks is None or not masks.capturable or hidden_states.dtype != torch.float32:
        return False
    first = module.gate_up_proj if getattr(module, "has_gate", False) else module.up_proj
    per_pair = (first[0].numel() + module.down_proj[0].numel()) * first.element_size()
    return top_k_index.numel() * per_pair <= STATIC_BATCHED_MAX_BYTES


def reference_experts(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
    """The reference experts kernel: transformers' ``grouped_mm`` path (sort by expert, torch's grouped matmul,
    its own fallback where torch has none) with gathers that never scatter in the backward
    (:func:`grouped_experts`) — the forward of a model built without ``"polyrl"``, bit for bit. Inside a static
    decode step to be captured, in float32: the ``batched_mm`` path (:func:`_static_step_batched`), which a device
    graph can capture."""
    from transformers.integrations.moe import batched_mm_experts_forward

    if _static_step_batched(module, hidden_states, top_k_index):
        return batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    return grouped_experts(module, hidden_states, top_k_index, top_k_weights)


def _gathers():
    """The two autograd functions of the experts' gathers (built on first use: torch is imported lazily here)."""
    import torch

    class RowGather(torch.autograd.Function):
        """``x.index_select(0, index)`` whose backward is a gather too. ``inverse`` lists, for each of the
        ``x.shape[0] * fan_out`` (source row, copy) pairs in source-major order, the output row that holds it: the
        backward gathers those rows and sums each source row's ``fan_out`` copies in that order."""

        @staticmethod
        def forward(ctx, x, index, inverse, fan_out):
            ctx.save_for_backward(inverse)
            ctx.fan_out, ctx.rows = fan_out, x.shape[0]
            return x.index_select(0, index)

        @staticmethod
        def backward(ctx, grad):
            (inverse,) = ctx.saved_tensors
            rows = grad.index_select(0, inverse)
            if ctx.fan_out > 1:
                rows = rows.view(ctx.rows, ctx.fan_out, *grad.shape[1:]).sum(dim=1)
            return rows, None, None, None

    class BiasGather(torch.autograd.Function):
        """``bias.index_select(0, expert_ids)``, one row per (token, expert) pair, ``expert_ids`` sorted (the
        experts' grouped order). Backward: each expert's rows summed in a float32 (or wider) buffer, in row order,
        deterministically on every device. With torch's deterministic algorithms on (polyrl's CPU runs):
        ``index_add_``, a serial loop on the CPU (sorted on CUDA). Off (the accelerators' runs): each expert's rows
        are one contiguous run, so ``torch.segment_reduce`` over the run bounds sums them, one thread per (expert,
        column) in row order: no sort and no atomics (where ``index_put_(accumulate=True)``, the scatter behind
        ``tensor[index]``'s backward, sorts on CUDA), the same bits as ``index_add_``'s loop. A device whose torch
        has no segment_reduce kernel (NotImplementedError) takes ``index_put_(accumulate=True)``. Why not the
        segmented sum everywhere: torch's CPU segment_reduce took 4-18x ``index_add_``'s time at the tiny recipes'
        shapes (docs/performance.md)."""

        @staticmethod
        def forward(ctx, bias, expert_ids, ends):
            ctx.save_for_backward(expert_ids, ends)
            ctx.bias_shape, ctx.bias_dtype = bias.shape, bias.dtype
            return bias.index_select(0, expert_ids)

        @staticmethod
        def backward(ctx, grad):
            expert_ids, ends = ctx.saved_tensors
            acc_dtype = torch.promote_types(ctx.bias_dtype, torch.float32)
            if torch.are_deterministic_algorithms_enabled():
                acc = grad.new_zeros(ctx.bias_shape, dtype=acc_dtype).index_add_(0, expert_ids, grad.to(acc_dtype))
                return acc.to(ctx.bias_dtype), None, None
            try:
                acc = segment_sums(grad.to(acc_dtype), ends)
            except NotImplementedError:
                acc = grad.new_zeros(ctx.bias_shape, dtype=acc_dtype)
                acc.index_put_((expert_ids,), grad.to(acc_dtype), accumulate=True)
            return acc.to(ctx.bias_dtype), None, None

    return RowGather, BiasGather


_GATHERS = None


def expert_ends(expert_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Each expert's end row in ``expert_ids [S]`` sorted ascending (int32 [experts]: expert e's rows are
    ``ends[e - 1] <= row < ends[e]``): transformers' cumsum of a histc, exactly (integers), without its per-device
    histc dtype; no host read, so a device graph can capture it."""
    import torch

    bounds = torch.arange(1, experts + 1, device=expert_ids.device, dtype=expert_ids.dtype)
    return torch.searchsorted(expert_ids, bounds, out_int32=True)


def segment_sums(rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``[experts, width]``: each expert's rows of ``rows [S, width]`` (grouped by expert) summed in row order,
    ``ends`` the experts' end rows (``expert_ends``), so each expert's rows are one contiguous run
    (``torch.segment_reduce`` over the run bounds; an expert without rows sums to 0). NotImplementedError where
    torch has no kernel for the device."""
    import torch

    offsets = torch.cat([ends.new_zeros(1), ends])  # expert e's rows: offsets[e] <= row < offsets[e + 1]
    return torch.segment_reduce(rows, "sum", offsets=offsets, axis=0, unsafe=True, initial=0.0)


def _gather_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, fan_out: int = 1) -> torch.Tensor:
    """``x[index]`` where every row of ``x`` is taken exactly ``fan_out`` times, ``inverse`` saying where (see
    RowGather); a permutation is ``fan_out=1`` with ``inverse`` its inverse permutation."""
    import torch

    global _GATHERS
    if not (torch.is_grad_enabled() and x.requires_grad):  # nothing to differentiate: the plain gather
        return x.index_select(0, index)
    if _GATHERS is None:
        _GATHERS = _gathers()
    return _GATHERS[0].apply(x, index, inverse, fan_out)


def _gather_bias(bias: torch.Tensor, expert_ids: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``bias[expert_ids]`` for ``expert_ids`` sorted ascending (``ends``: its ``expert_ends``), with a
    deterministic float32 backward (see BiasGather)."""
    import torch

    global _GATHERS
    if not (torch.is_grad_enabled() and bias.requires_grad):
        return bias.index_select(0, expert_ids)
    if _GATHERS is None:
        _GATHERS = _gathers()
    return _GATHERS[1].apply(bias, expert_ids, ends)


def grouped_experts(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts path (``grouped_mm_experts_forward``: the same sort, offsets, grouped
    matmuls, gating and sum over the k slots, so the same forward bit for bit) with cheaper gathers.

    transformers gathers with ``tensor[index]``, whose backward is ``index_put_(accumulate=True)``: a sort and a
    pass over the sorted indices on CUDA (its ``indexing_backward_kernel`` measured about 30% of the tiny GPT-OSS
    recipe's GPU time on an H100) and, under deterministic algorithms (polyrl's CPU runs), a serial loop on the CPU.
    Here the token rows, the routing weights and the final un-sort are gathers whose backward is a gather as well
    (each token's k rows summed in slot order, a permutation undone by its inverse), and the per-row biases'
    gradients are sums over the expert-sorted rows (BiasGather: ``index_add_`` under deterministic algorithms, else
    a segmented sum). With k = 2 every gradient is the one transformers' path gives, bit for bit (two terms add the
    same in either order); with k > 2 the input gradient sums a token's rows in slot order instead of expert order;
    the bias gradients are summed in float32 (bf16: closer to exact than transformers' bf16 accumulation).
    transformers' own expert parallelism (sentinel expert ids) and a transformers without the helper used here run
    its function unchanged."""
    import torch

    try:
        from transformers.integrations.moe import _grouped_linear
    except ImportError:  # a transformers that renamed its helper: its whole path, gathers and all
        _grouped_linear = None
    if _grouped_linear is None or getattr(module, "_is_expert_parallel", False):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)

    num_tokens, k = top_k_index.shape
    hidden_dim = hidden_states.shape[-1]
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))  # the (token, slot) pairs grouped by expert
    inv_perm = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    rows = _gather_rows(hidden_states, perm // k, inv_perm, k)  # pair j of token t is row inv_perm[t * k + j]
    weights_g = _gather_rows(top_k_weights.reshape(-1), perm, inv_perm)

    offsets = expert_ends(expert_ids_g, module.num_experts)  # the grouped matmuls' and the bias gradients' runs

    first = module.gate_up_proj if module.has_gate else module.up_proj
    first_bias = (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias) if module.has_bias else None
    out = _grouped_linear(rows, first, offsets, is_transposed=module.is_transposed,
                          bias=None if first_bias is None else _gather_bias(first_bias, expert_ids_g, offsets))
    out = module._apply_gate(out) if module.has_gate else module.act_fn(out)
    down_bias = _gather_bias(module.down_proj_bias, expert_ids_g, offsets) if module.has_bias else None
    out = _grouped_linear(out, module.down_proj, offsets, bias=down_bias, is_transposed=module.is_transposed)
    out = out * weights_g.unsqueeze(-1)
    out = _gather_rows(out, inv_perm, perm)  # back to (token, slot) order
    return out.view(num_tokens, k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def register() -> None:
    """Register ``"polyrl"`` in transformers' experts interface (idempotent; imports transformers)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(NAME, polyrl_experts_forward)
