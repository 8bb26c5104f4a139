"""Building a sharded model without a full copy on every rank: rank 0 holds the weights, the others a skeleton.

Under ``--nproc`` with sharding on, rank 0 builds the model as a single process would (checkpoint load or seeded
init, on the host); every other rank builds the same architecture on the meta device (no memory for weights,
``build_model(meta=True)``). :func:`shard_from_rank0` then shards the model with FSDP2 on every rank
(``fully_shard`` accepts meta modules), gives each rank's shards storage on its device (``to_empty``) and loads
rank 0's full state dict into them with torch's ``set_model_state_dict(full_state_dict=True,
broadcast_from_rank0=True)``: one tensor at a time is broadcast from rank 0 and each rank keeps its slice. The
buffers a state dict leaves out (non-persistent ones, e.g. the rotary ``inv_freq``) are broadcast from rank 0
afterwards, so every rank ends with rank 0's exact values, which are the single-process build's.

:func:`meta_copy` gives the frozen reference model the same way: a meta skeleton of the (unsharded) actor,
loaded from the actor's full state dict, so that rank 0 never holds two full models either.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn

    from polyrl.core.config.schema import ShardingConfig
    from polyrl.core.plugins.backend import Backend


def builds_on_rank0(settings: ShardingConfig) -> bool:
    """True where only rank 0 builds real weights: several processes and sharding on (without sharding every
    rank trains its own full copy, so every rank builds it)."""
    import torch.distributed as dist

    return settings.enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_rank0() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == 0


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters are on the meta device (buffers are copied: they are small).
    Tied parameters stay tied (one meta parameter for both)."""
    from torch import nn

    memo: dict[int, Any] = {}
    for p in model.parameters():  # parameters() yields a tied parameter once
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)


def non_persistent_buffers(model: nn.Module) -> list[str]:
    """Names of the buffers that ``state_dict`` leaves out."""
    return [f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules() for name in module._non_persistent_buffers_set
            if module._buffers.get(name) is not None]


def _layout(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in (*model.named_parameters(), *model.named_buffers())]


def shard_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor] | None, backend: Backend,
                     settings: ShardingConfig, device: torch.device) -> nn.Module:
    """Shard ``model`` (rank 0: real weights; other ranks: the same architecture, parameters on meta) and load
    ``full_state`` (rank 0's full state dict, None elsewhere; default: rank 0's ``model.state_dict()``) into
    every rank's shards. Every rank must call it (collective). Returns the same module."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from polyrl.core.distributed import broadcast_object
    from polyrl.core.distributed.process_group import _on_comm_device
    from polyrl.core.distributed.sharding import apply_sharding

    rank0 = is_rank0()
    # The skeleton must be rank 0's model exactly: the load copies into whatever dtype a shard has, so a
    # mismatch would otherwise pass silently.
    expected = broadcast_object(_layout(model) if rank0 else None)
    if _layout(model) != expected:
        mine = dict((n, (s, d)) for n, s, d in _layout(model))
        diff = [n for n, s, d in expected if mine.pop(n, None) != (s, d)] + sorted(mine)
        raise RuntimeError(f"rank {dist.get_rank()}: the meta-device build differs from rank 0's model at "
                           f"{', '.join(diff[:4])}")
    if rank0 and full_state is None:
        full_state = model.state_dict()  # references to the unsharded tensors: no copy
    extra = non_persistent_buffers(model)
    kept = {n: model.get_buffer(n) for n in extra} if rank0 else {}
    apply_sharding(model, backend, settings)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        # Storage for this rank's shards and buffers (all of them: to_empty leaves no tensor as it was; on rank 0,
        # whose reference model is a meta copy, the values come back from full_state and ``kept``). A real model
        # (rank 0's actor) keeps the shards fully_shard cut from its weights: no second allocation.
        model.to_empty(device=torch.device("cpu") if settings.cpu_offload else device)
    # A copy: set_model_state_dict replaces the dict's entries with the loaded shards, and the reference model
    # loads the same full state after the actor.
    set_model_state_dict(model, dict(full_state) if rank0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True))
    with torch.no_grad():
        for name in extra:
            buf = model.get_buffer(name)
            if rank0:
                buf.copy_(kept[name])
            comm = _on_comm_device(buf)
            dist.broadcast(comm, src=0)
            if comm is not buf:
                buf.copy_(comm)
    return model
