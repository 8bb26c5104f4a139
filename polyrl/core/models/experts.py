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
    its own fallback where torch has none) — what a model built without ``"polyrl"`` runs by default, so the
    numbers of the cpu and cuda backends are the ones they had. Inside a static decode step to be captured, in
    float32: the ``batched_mm`` path (:func:`_static_step_batched`), which a device graph can capture."""
    from transformers.integrations.moe import batched_mm_experts_forward, grouped_mm_experts_forward

    if _static_step_batched(module, hidden_states, top_k_index):
        return batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    return grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Register ``"polyrl"`` in transformers' experts interface (idempotent; imports transformers)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(NAME, polyrl_experts_forward)
