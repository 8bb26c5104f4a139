"""Expert parallelism: the experts of every MoE layer split over the ``ep`` dimension of a device mesh.

``shard_experts(model, backend, ep_mesh)`` (called by ``apply_sharding`` when ``sharding.expert_parallel`` > 1)
replaces each transformers experts module (GPT-OSS's ``GptOssExperts``, DeepSeek-V3's ``DeepseekV3Experts``: fused
3-D ``gate_up_proj`` / ``down_proj`` tensors, [E, ...] first) by an :class:`ExpertParallelExperts` holding the same
parameters, under the same names, as DTensors sharded along E over the ``ep`` mesh: rank r of an ep group holds
experts ``[r * E/ep, (r + 1) * E/ep)``. The router and DeepSeek-V3's shared experts are left alone (replicated
for FSDP2 over the whole world), so the routing is transformers' own, identical on every rank.

A forward of the MoE layer then runs, on every rank of the ep group (SPMD: every rank calls it as often as
the others, as FSDP2 already requires):

1. ``backend.collectives.expert_dispatch`` (default: polyrl.core.plugins.expert_exchange): every (token, expert)
   pair becomes one row, rows are sorted by expert (so by the rank that holds it), the per-expert row counts are
   exchanged (``all_to_all`` of E integers), then the rows themselves (``all_to_all`` with the variable split
   sizes those counts give; no capacity, no token is ever dropped), and the received rows are grouped by local
   expert;
2. the local experts compute their rows with transformers' own experts function on the local weights (whatever
   ``model.experts_implementation`` selects: eager, grouped_mm, ...), so an expert computes exactly what it
   computes without expert parallelism (routing weight 1: the weighting is the combine's);
3. ``backend.collectives.expert_combine``: the rows go back by the inverse ``all_to_all``, and each token's k rows are
   weighted by its routing weights and summed.

Backward runs the same two row exchanges in reverse (the all-to-all's gradient is the all-to-all with the
split sizes swapped). An expert's gradient thus gathers the contributions of every token of the ep group on
the rank that holds it; FSDP2 over the other mesh dimension (``efsdp`` = world / ep) then sums it over the
ranks that hold the same experts, and only over them.
"""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from polyrl.core.plugins.expert_exchange import group_size

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from polyrl.core.plugins.backend import Backend

# The parameters of a transformers experts module that are split along their first dimension (the experts).
_EXPERT_PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")

# --- the module -------------------------------------------------------------------------------------------
def is_hf_experts(module: nn.Module) -> bool:
    """A transformers fused-experts module: ``num_experts`` and 3-D [E, ...] ``gate_up_proj`` / ``down_proj``."""
    if isinstance(module, ExpertParallelExperts):
        return False
    params = dict(module.named_parameters(recurse=False))
    E = getattr(module, "num_experts", None)
    return (isinstance(E, int) and all(n in params and params[n].dim() == 3 and params[n].shape[0] == E
                                       for n in ("gate_up_proj", "down_proj"))
            and set(params) <= set(_EXPERT_PARAMS))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class ExpertParallelExperts(nn.Module):
    """Drop-in for a transformers experts module: ``forward(hidden [T, H], top_k_index [T, k], top_k_weights
    [T, k]) -> [T, H]``, the same parameters under the same names (so checkpoints and HF export see the same
    tensors), computed by dispatch -> local experts -> combine through ``backend``.

    ``group`` None: every expert is here (the exchange is only a permutation; the one-process reference of the
    parallel path). Otherwise the parameters hold this rank's ``E / ep`` experts (DTensors on the ep mesh, see
    :func:`shard_experts`, or plain local tensors)."""

    def __init__(self, experts: nn.Module, backend: Backend, group: ProcessGroup | None = None) -> None:
        super().__init__()
        if not is_hf_experts(experts):
            raise TypeError(f"{type(experts).__name__} is not a fused experts module")
        self.num_experts = int(experts.num_experts)
        self.backend = backend
        self.group = group
        self.param_names = tuple(n for n, _ in experts.named_parameters(recurse=False))
        for name, param in experts.named_parameters(recurse=False):
            self.register_parameter(name, param)
        # transformers' own experts function, on a parameter-less shallow copy of the module: the local weights
        # are set on it for the call (step 2 of the module docstring). Kept out of the module tree (a tuple) so
        # that it adds no state and no submodule.
        view = copy.copy(experts)
        view._parameters, view._buffers, view._modules = {}, dict(experts._buffers), dict(experts._modules)
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            setattr(view, hooks, type(getattr(experts, hooks))())
        self._view = (view,)

    @property
    def ep(self) -> int:
        return group_size(self.group)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, ep={self.ep}"

    def local_experts(self, tokens: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Each row through its local expert, unweighted: transformers' experts function with k = 1 and weight 1
        (exact: ``x * 1`` is ``x``)."""
        view = self._view[0]
        weights = {n: _local(getattr(self, n)) for n in self.param_names}
        view.num_experts = weights["gate_up_proj"].shape[0]
        view.__dict__.update(weights)
        try:
            ones = torch.ones((tokens.shape[0], 1), dtype=tokens.dtype, device=tokens.device)
            out = view(tokens, expert_ids[:, None], ones)
        finally:
            for n in weights:
                view.__dict__.pop(n, None)
        if tokens.shape[0] == 0:
            # No row here: keep every local weight in the graph (a zero gradient), so that this rank's FSDP2
            # reduces the same gradients as its peers.
            out = out + sum(w.sum() * 0 for w in weights.values())
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        collectives = self.backend.collectives
        d = collectives.expert_dispatch(hidden_states, top_k_index, num_experts=self.num_experts, group=self.group)
        out = self.local_experts(d.tokens, d.expert_ids)  # [N, H]
        return collectives.expert_combine(out, d, top_k_weights)


def experts_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, experts module) of every transformers experts module of ``model``."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if is_hf_experts(child):
                found.append((parent, name, child))
    return found


def shard_experts(model: nn.Module, backend: Backend, ep_mesh: DeviceMesh) -> list[ExpertParallelExperts]:
    """Replace every experts module of ``model`` by an :class:`ExpertParallelExperts` over ``ep_mesh`` (1-D),
    its expert parameters DTensors ``Shard(0)`` on it; returns the new modules (FSDP2 then shards them over the
    other mesh dimension). Every rank must hold the same full weights (a seeded build, or a checkpoint loaded
    afterwards): each keeps its own slice, nothing is sent."""
    from torch.distributed.tensor import DTensor, Shard

    from polyrl.core.errors import BadInputError

    ep = ep_mesh.size()
    rank = ep_mesh.get_local_rank()
    out = []
    for parent, name, experts in experts_modules(model):
        E = int(experts.num_experts)
        if E % ep:
            raise BadInputError(f"sharding.expert_parallel={ep} must divide the number of experts ({E}) of "
                                f"{type(experts).__name__}")
        module = ExpertParallelExperts(experts, backend, group=ep_mesh.get_group())
        local = E // ep
        for pname in module.param_names:
            full = getattr(module, pname)
            part = full.detach()[rank * local:(rank + 1) * local].clone()
            dt = DTensor.from_local(part, ep_mesh, [Shard(0)], run_check=False, shape=full.shape,
                                    stride=full.stride())
            setattr(module, pname, nn.Parameter(dt, requires_grad=full.requires_grad))
        setattr(parent, name, module)
        out.append(module)
    return out


# Moved in 0.3.0 to polyrl.core.plugins.expert_exchange (the collectives part's default), where dispatch and combine
# take the all-to-all function; the old names keep the 0.2 signatures (a backend first) for one more release.
def _old_dispatch(backend: Backend, *args: Any, **kwargs: Any) -> Any:
    from polyrl.core.plugins.expert_exchange import dispatch

    return dispatch(backend.collectives.all_to_all, *args, **kwargs)


def _old_combine(backend: Backend, *args: Any, **kwargs: Any) -> Any:
    from polyrl.core.plugins.expert_exchange import combine

    return combine(backend.collectives.all_to_all, *args, **kwargs)


def _old_all_to_all_rows(backend: Backend, *args: Any, **kwargs: Any) -> Any:
    from polyrl.core.plugins.expert_exchange import all_to_all_rows

    return all_to_all_rows(backend.collectives.all_to_all, *args, **kwargs)


def __getattr__(name: str) -> Any:
    from polyrl.core.plugins import expert_exchange

    old = {"ExpertDispatch": expert_exchange.ExpertDispatch, "dispatch": _old_dispatch, "combine": _old_combine,
           "all_to_all_rows": _old_all_to_all_rows}
    if name not in old:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"polyrl.core.distributed.expert_parallel.{name} is deprecated and will be removed in polyrl "
                  f"0.4.0; use polyrl.core.plugins.expert_exchange.{name} (or backend.collectives)",
                  DeprecationWarning, stacklevel=2)
    return old[name]
