"""FSDP2 sharding of the actor, reference model and critic, with the backend's quirks applied.

Order (as torchtitan's parallelize functions): ``fully_shard`` every decoder layer, then the root. Each
layer is then one all-gather unit (gathered just before its forward, freed after), and the root unit
holds what is left (embeddings, final norm, LM head / value head). The model itself knows nothing about
parallelism; this module is the only place that wraps it.

Two inputs, two owners: the recipe's choices are :class:`polyrl.core.config.ShardingConfig` (``sharding:``:
enabled, CPU offload, resharding after forward, and the mixed-precision dtypes where it sets them); what the backend
imposes is its :class:`~polyrl.core.plugins.backend.ShardingPolicy` (``Backend.sharding_policy()``: fp32 params and
reductions on the CPU reference, bf16 params with fp32 gradient reduction on accelerators, refused world sizes, SUM
reduction). :func:`sharding_policy` is the two merged: the recipe's ``sharding.param_dtype`` /
``sharding.reduce_dtype`` replace the policy's where set. The optimizer always holds fp32 sharded master weights.
Without a process group (a single process) sharding is skipped and the model is returned as is: the 1-process run
is the plain reference the N-process run must match.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from polyrl.core.config.schema import ShardingConfig
from polyrl.core.dtypes import torch_dtype
from polyrl.core.errors import BadInputError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from polyrl.core.config.schema import RunConfig
    from polyrl.core.plugins.backend import Backend, ShardingPolicy

# Attribute paths where decoder layers live in the model families polyrl trains (HF causal LMs keep
# them at ``model.layers``; a critic wrapping a backbone at ``backbone.model.layers``).
_LAYER_PATHS = ("model.layers", "layers", "backbone.model.layers", "backbone.layers", "transformer.h")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the first ModuleList found at a known path, else by class name.

    The class-name fallback uses HF's ``_no_split_modules`` (the classes transformers itself never
    splits across devices), which names exactly the decoder-layer classes.
    """
    from torch import nn

    for path in _LAYER_PATHS:
        node: object = model
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, nn.ModuleList) and len(node) > 0:
            return list(node)
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


def check_placement(cfg: RunConfig, backend: Backend, world_size: int) -> None:
    """Everything about running ``cfg`` on ``world_size`` processes of ``backend`` that can be refused before
    any process starts (the launcher and the dry run call it; the trainer's own checks are the recipe's):
    the world sizes the backend's collective library refuses, the sharding settings it cannot honour, and
    prompts that do not split equally over the processes."""
    if world_size < 1:
        raise BadInputError(f"the world size must be >= 1, got {world_size}")
    check_sharding(backend, world_size, cfg.sharding)
    if cfg.data.batch_size % world_size:
        raise BadInputError(
            f"data.batch_size ({cfg.data.batch_size}) must be a multiple of the world size ({world_size} "
            "processes: --nproc x --nnodes): each process takes an equal share of the prompts"
        )


def sharding_policy(backend: Backend, settings: ShardingConfig | None = None) -> ShardingPolicy:
    """The backend's ``ShardingPolicy`` with the recipe's mixed-precision choices (``sharding.param_dtype`` /
    ``sharding.reduce_dtype``, where set) in place of its own: what FSDP2, the memory plan and the sync probe's
    tolerance use."""
    policy = backend.placement.sharding_policy()
    if settings is None:
        return policy
    changes = {field: getattr(settings, field) for field in ("param_dtype", "reduce_dtype")
               if getattr(settings, field) is not None}
    return dataclasses.replace(policy, **changes) if changes else policy


def check_sharding(backend: Backend, world_size: int, settings: ShardingConfig) -> None:
    """Refuse the recipe's ``settings`` where the backend's policy cannot honour them, and world sizes its
    collective library refuses, with a message that says what to change."""
    backend.placement.check_world_size(world_size)
    policy = sharding_policy(backend, settings)
    if settings.cpu_offload and not policy.cpu_offload_supported:
        raise BadInputError(
            f"backend {backend.name!r} does not support sharding.cpu_offload "
            f"(on the cpu backend parameters already live in host memory); set sharding.cpu_offload=false"
        )
    for field in ("param_dtype", "reduce_dtype"):
        what = (f"sharding.{field}" if getattr(settings, field) is not None
                else f"backend {backend.name!r} sharding policy {field}")
        torch_dtype(getattr(policy, field), what=what)
    ep = settings.expert_parallel
    if ep < 1:
        raise BadInputError(f"sharding.expert_parallel: expected an integer >= 1, got {ep}")
    if ep > 1 and world_size > 1 and not settings.enabled:
        raise BadInputError(f"sharding.expert_parallel={ep} needs sharding.enabled=true (the experts are split by "
                            "FSDP2's device mesh)")
    if ep > 1 and world_size % ep:
        raise BadInputError(f"sharding.expert_parallel={ep} must divide the world size ({world_size} processes: "
                            "--nproc x --nnodes)")
    if ep > 1 and world_size > 1:  # the experts' two groups gather too: FSDP2 over world / ep, export over ep
        for size, what in ((world_size // ep, f"FSDP2 shards the experts over groups of world / ep = {world_size // ep}"),
                           (ep, f"the expert-parallel groups have {ep} processes")):
            rule = policy.refusal(size, backend.collective_backend)
            if rule is not None:
                raise BadInputError(f"sharding.expert_parallel={ep} on {world_size} processes: {what}, which backend "
                                    f"{backend.name!r} refuses ({rule}); choose an expert_parallel that makes "
                                    f"neither ep nor world / ep one of {list(policy.world_sizes_refused)}")
    if world_size > 1 and settings.enabled:
        missing = missing_fsdp2_methods()
        if missing:
            import torch

            raise BadInputError(
                f"torch {torch.__version__}: FSDP2 has no {' / '.join(missing)} (added in torch 2.8), which polyrl "
                "needs to sum gradients over ranks with plain SUM (gloo and HCCL have no PREMUL_SUM); "
                "run with --nproc 1 or install torch >= 2.8 (with its matching torch_npu on Ascend)"
            )


# Recent FSDP2 methods polyrl calls on every sharded module; older torch releases (which some torch_npu pairs still
# use) lack them. Feature-detected, so that the refusal is a message before any process starts, not an
# AttributeError inside the first sharded run.
FSDP2_SUM_METHODS = ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms")


def missing_fsdp2_methods() -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in FSDP2_SUM_METHODS if not hasattr(FSDPModule, m)]


def apply_sharding(model: nn.Module, backend: Backend, settings: ShardingConfig | None = None) -> nn.Module:
    """Shard ``model`` in place with FSDP2 (per decoder layer, then the root) as the recipe's ``settings``
    (None: the defaults) and the backend's ``sharding_policy()`` say; returns the same module.

    No-op without an initialised process group. Call it on the actor, the reference model and the
    critic alike, before building their optimizers (the optimizer must see the sharded DTensor params).

    Gradients are SUMMED across ranks (not averaged): a rank's loss must be its share of the global loss,
    e.g. token-mean = this rank's masked sum / the token count of the whole batch over all ranks.
    """
    import torch.distributed as dist

    settings = settings if settings is not None else ShardingConfig()
    if not settings.enabled or not (dist.is_available() and dist.is_initialized()):
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    world_size = dist.get_world_size()
    check_sharding(backend, world_size, settings)
    policy = sharding_policy(backend, settings)
    kwargs = {
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=torch_dtype(policy.param_dtype, what=f"backend {backend.name!r} sharding policy param_dtype"),
            reduce_dtype=torch_dtype(policy.reduce_dtype, what=f"backend {backend.name!r} sharding policy reduce_dtype"),
        ),
        "offload_policy": CPUOffloadPolicy() if settings.cpu_offload else OffloadPolicy(),
        "reshard_after_forward": settings.reshard_after_forward,
    }
    # Any dtype cast happens before this point (build_models builds in the recipe's dtype): after fully_shard the
    # parameters are DTensors, and on NPU torch_npu's dtype cast (_npu_dtype_cast) has no DTensor rule.
    layers = decoder_layers(model)
    if not layers:
        raise BadInputError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    units: list[nn.Module] = []
    ep = settings.expert_parallel
    if ep > 1:
        from polyrl.core.distributed.expert_parallel import shard_experts

        # 2-D mesh (efsdp, ep), row-major: an ep group is ep consecutive ranks (one node's fast links when ep
        # divides the devices per node). The experts are DTensors Shard(0) over "ep"; fully_shard over "efsdp"
        # adds its own sharding on top and reduces their gradients over "efsdp" only: the ranks that hold the
        # same experts. Must come before the layers' fully_shard, which then leaves the experts to their unit.
        expert_mesh = _expert_mesh(backend.device_type, world_size, ep)
        experts = shard_experts(model, backend, expert_mesh["ep"])
        if not experts:
            raise BadInputError(f"sharding.expert_parallel={ep}: {type(model).__name__} has no MoE experts to split")
        for module in experts:
            fully_shard(module, mesh=expert_mesh["efsdp"], **kwargs)
        units += experts
    mesh = init_device_mesh(backend.device_type, (world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    # Sum gradients over ranks instead of FSDP's default mean: each rank's loss is already its share of
    # the global loss (local token sum / global token count, A.aggregate with the all-reduced count), so
    # the same loss code gives the same gradient with 1 or N processes.
    for module in [*units, *layers, model]:
        module.set_gradient_divide_factor(1.0)
        if policy.force_sum_reduction:  # the backend's collective library has no PREMUL_SUM (gloo, HCCL)
            module.set_force_sum_reduction_for_comms(True)
    return model


_EXPERT_MESHES: dict[tuple, object] = {}


def _expert_mesh(device_type: str, world_size: int, ep: int):
    """The (efsdp, ep) mesh, one per process group: the actor, the reference and the critic share its groups
    (each new group costs the collective library its own buffers on every rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    key = (dist.group.WORLD, device_type, world_size, ep)  # the group itself: a new process group, new meshes
    if key not in _EXPERT_MESHES:
        _EXPERT_MESHES[key] = init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=("efsdp", "ep"))
    return _EXPERT_MESHES[key]


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """Global L2 grad norm over all parameters (sharded DTensor or plain), then clip to ``max_norm``.

    Returns the pre-clip total norm as a plain (replicated) scalar tensor on every rank: for DTensor
    grads the per-shard squares are summed across the mesh, so the result equals the unsharded norm.
    ``max_norm=None`` or ``<= 0`` measures without clipping.
    """
    import torch
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    # Sum of squares of what this rank holds: sharded DTensors contribute their local shard and are
    # summed across their mesh with one all-reduce per mesh; anything else (plain tensors, replicated
    # DTensors) is counted once, as it is identical on every rank.
    device = grads[0].to_local().device if isinstance(grads[0], DTensor) else grads[0].device
    local_sq = torch.zeros((), dtype=torch.float32, device=device)
    sharded_sq: dict[object, torch.Tensor] = {}
    for g in grads:
        if isinstance(g, DTensor) and all(pl.is_shard() for pl in g.placements):
            part = torch.linalg.vector_norm(g.to_local(), 2, dtype=torch.float32) ** 2
            mesh = g.device_mesh
            sharded_sq[mesh] = sharded_sq.get(mesh, torch.zeros_like(local_sq)) + part.to(device)
        elif isinstance(g, DTensor):
            local_sq = local_sq + torch.linalg.vector_norm(g.full_tensor(), 2, dtype=torch.float32).to(device) ** 2
        else:
            local_sq = local_sq + torch.linalg.vector_norm(g, 2, dtype=torch.float32).to(device) ** 2
    for mesh, sq in sharded_sq.items():
        import torch.distributed as dist

        for dim in range(mesh.ndim):
            dist.all_reduce(sq, group=mesh.get_group(dim))
        local_sq = local_sq + sq
    total = local_sq.sqrt()
    if max_norm is not None and max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            local.mul_(coef.to(local.device))
    return total
