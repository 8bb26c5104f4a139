"""Expert parallelism: the experts of every MoE layer split over the ``ep`` dimension of a device mesh.

``shard_experts(model, backend, ep_mesh)`` (called by ``apply_sharding`` when ``sharding.expert_parallel`` > 1)
replaces each transformers experts module (GPT-OSS's ``GptOssExperts``, DeepSeek-V3's ``DeepseekV3Experts``: fused
3-D ``gate_up_proj`` / ``down_proj`` tensors, [E, ...] first) by an :class:`ExpertParallelExperts` holding the same
parameters, under the same names, as DTensors sharded along E over the ``ep`` mesh: rank r of an ep group holds
experts ``[r * E/ep, (r + 1) * E/ep)``. The router and DeepSeek-V3's shared experts are left alone (replicated
for FSDP2 over the whole world), so the routing is transformers' own, identical on every rank.

A forward of the MoE layer then runs, on every rank of the ep group (SPMD: every rank calls it as often as
the others, as FSDP2 already requires):

1. ``Backend.expert_dispatch``: every (token, expert) pair becomes one row, rows are sorted by expert (so by
   the rank that holds it), the per-expert row counts are exchanged (``all_to_all`` of E integers), then the
   rows themselves (``all_to_all`` with the variable split sizes those counts give; no capacity, no token is
   ever dropped), and the received rows are grouped by local expert;
2. the local experts compute their rows with transformers' own experts function on the local weights (whatever
   ``model.experts_implementation`` selects: eager, grouped_mm, ...), so an expert computes exactly what it
   computes without expert parallelism (routing weight 1: the weighting is the combine's);
3. ``Backend.expert_combine``: the rows go back by the inverse ``all_to_all``, and each token's k rows are
   weighted by its routing weights and summed.

Backward runs the same two row exchanges in reverse (the all-to-all's gradient is the all-to-all with the
split sizes swapped). An expert's gradient thus gathers the contributions of every token of the ep group on
the rank that holds it; FSDP2 over the other mesh dimension (``efsdp`` = world / ep) then sums it over the
ranks that hold the same experts, and only over them.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from polyrl.core.plugins.backend import Backend

# The parameters of a transformers experts module that are split along their first dimension (the experts).
_EXPERT_PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


@dataclasses.dataclass
class ExpertDispatch:
    """What ``dispatch`` hands the local experts and ``combine`` needs to bring their rows back.

    ``tokens`` [N, H]: the rows this rank's experts compute, grouped by local expert (ascending); ``expert_ids``
    [N]: their local expert index. The rest is the default implementation's bookkeeping (a backend's fused
    dispatch keeps its own in ``state``)."""

    tokens: torch.Tensor
    expert_ids: torch.Tensor
    shape: tuple[int, int]  # (T, k) of the tokens dispatched
    order: torch.Tensor | None = None  # slot permutation: slot order -> sorted by global expert
    regroup: torch.Tensor | None = None  # received order -> grouped by local expert
    send_splits: list[int] | None = None  # rows sent to each rank of the group
    recv_splits: list[int] | None = None  # rows received from each rank of the group
    group: Any = None
    state: Any = None


class _AllToAll(torch.autograd.Function):
    """``Backend.all_to_all`` of rows with autograd: the gradient goes back by the inverse exchange."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, backend: Backend, group: Any, out_splits: list[int],
                in_splits: list[int]) -> torch.Tensor:
        ctx.backend, ctx.group, ctx.out_splits, ctx.in_splits = backend, group, out_splits, in_splits
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        backend.all_to_all(out, rows.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        ctx.backend.all_to_all(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group)
        return back, None, None, None, None


def all_to_all_rows(backend: Backend, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group: Any) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``rows`` (block r, ``in_splits[r]`` rows, goes to rank r)."""
    return _AllToAll.apply(rows, backend, group, out_splits, in_splits)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def group_size(group: Any) -> int:
    import torch.distributed as dist

    return 1 if group is None else dist.get_world_size(group)


def dispatch(backend: Backend, hidden: torch.Tensor, expert_ids: torch.Tensor, *, num_experts: int,
             group: Any = None) -> ExpertDispatch:
    """The default ``Backend.expert_dispatch`` (contract there)."""
    T, k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    # A stable sort keeps a token's rows for one expert in token order: the same rows, in the same order, on
    # every ep size, so an expert sees its rows in one order whatever the split.
    order = torch.argsort(flat, stable=True)
    rows = hidden[order // k]
    ep = group_size(group)
    if ep == 1:
        return ExpertDispatch(rows, flat[order], (T, k), order=order)
    local = num_experts // ep
    counts = torch.bincount(flat, minlength=num_experts)  # rows for each global expert
    recv_counts = torch.empty_like(counts)  # [ep, local]: rows each rank sends to each of this rank's experts
    backend.all_to_all(recv_counts, counts, None, None, group)
    send_splits = counts.view(ep, local).sum(1).tolist()
    recv_splits = recv_counts.view(ep, local).sum(1).tolist()
    received = all_to_all_rows(backend, rows, recv_splits, send_splits, group)
    # Received: source rank 0's rows (by local expert), then rank 1's, ...; group them by local expert.
    ids = torch.arange(local, device=flat.device).repeat(ep).repeat_interleave(recv_counts)
    regroup = torch.argsort(ids, stable=True)
    return ExpertDispatch(received[regroup], ids[regroup], (T, k), order=order, regroup=regroup,
                          send_splits=send_splits, recv_splits=recv_splits, group=group)


def combine(backend: Backend, expert_out: torch.Tensor, dispatched: ExpertDispatch,
            weights: torch.Tensor) -> torch.Tensor:
    """The default ``Backend.expert_combine`` (contract there)."""
    T, k = dispatched.shape
    rows = expert_out
    if dispatched.regroup is not None:
        rows = all_to_all_rows(backend, rows[_inverse(dispatched.regroup)], dispatched.send_splits,
                               dispatched.recv_splits, dispatched.group)
    slots = rows[_inverse(dispatched.order)].view(T, k, -1)
    # As transformers' grouped experts: weighted rows summed over k in the weights' dtype, then the tokens' dtype.
    return (slots * weights.unsqueeze(-1)).sum(dim=1).to(expert_out.dtype)


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

    def __init__(self, experts: nn.Module, backend: Backend, group: Any = None) -> None:
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
        d = self.backend.expert_dispatch(hidden_states, top_k_index, num_experts=self.num_experts, group=self.group)
        out = self.local_experts(d.tokens, d.expert_ids)
        return self.backend.expert_combine(out, d, top_k_weights)


def experts_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, experts module) of every transformers experts module of ``model``."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if is_hf_experts(child):
                found.append((parent, name, child))
    return found


def shard_experts(model: nn.Module, backend: Backend, ep_mesh: Any) -> list[ExpertParallelExperts]:
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
