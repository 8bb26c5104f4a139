"""Process-group bootstrap for SPMD runs under torchrun, and the few collectives the loop needs.

Every rank runs the same loop. torchrun exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
and ``MASTER_PORT``; ``init_distributed`` reads them and opens the default process group with the
active backend's collective library (gloo on CPU, nccl, hccl). Without those variables the run is a plain
single process and no process group is created: every helper here then degrades to the identity, so the
trainer calls them unconditionally.

Device-generic on purpose: collectives go through ``torch.distributed`` only; the device a tensor lives
on is the backend's (``backend.device(local_rank)``), never a hard-coded vendor module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from polyrl.core.errors import BadInputError

if TYPE_CHECKING:
    import torch

    from polyrl.core.plugins.backend import Backend

# Variables torchrun sets in every worker; their presence is how a process knows it is one rank of many.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job. ``device`` is the torch device its tensors live on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    initialized: bool  # True when a process group was created by (or before) init_distributed

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_comm_device: torch.device | None = None  # set by init_distributed from the backend: where collective buffers live
# Set by init_distributed from the backend (``Backend.collective_reduce_dtypes``): the torch dtypes its collective
# library reduces; None: every dtype. Another dtype is reduced through a gather (``_all_reduce_by_gather_``).
_reduce_dtypes: frozenset[torch.dtype] | None = None


def under_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """True inside a torchrun worker (the launcher must not launch again)."""
    env = os.environ if env is None else env
    return "RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env


def apply_env_defaults(backend: Backend) -> dict[str, str]:
    """Set the backend's environment defaults (allocator, collective timeouts) unless the user set them.

    Returns what was set. Must run before the device runtime and the collective library start.
    """
    applied: dict[str, str] = {}
    for key, value in backend.placement.sharding_policy().env_defaults.items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied


def init_distributed(backend: Backend, *, timeout_s: float | None = None) -> DistContext:
    """Open the default process group from torchrun's environment, or describe a single process.

    Refuses world sizes the backend's collective library cannot handle (BadInputError). Idempotent: a
    process group that already exists is reused.
    """
    import torch.distributed as dist

    global _comm_device, _reduce_dtypes
    apply_env_defaults(backend)
    if not under_torchrun():
        return DistContext(0, 1, 0, backend.bind_device(0), dist.is_available() and dist.is_initialized())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    backend.placement.check_world_size(world_size)
    if not dist.is_available():
        raise BadInputError("this torch build has no torch.distributed; run without --nproc")
    # Bind the rank to its device first so the collective library does not guess.
    device = backend.bind_device(local_rank)
    _comm_device = backend.collectives.comm_device(local_rank)
    _reduce_dtypes = reduce_dtypes(backend)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend.collective_backend, "rank": rank, "world_size": world_size}
        if timeout_s is not None:
            import datetime

            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        kwargs.update(backend.collectives.process_group_options(local_rank))
        dist.init_process_group(**kwargs)
    return DistContext(rank, world_size, local_rank, device, True)


def shutdown_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# --- where am I ---------------------------------------------------------------------------------------
def is_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    """Wait for every rank; nothing in one process (where an in-process vLLM engine's own process group of world
    size 1 would otherwise be asked)."""
    import torch.distributed as dist

    if is_distributed():
        dist.barrier()


# --- splitting work ----------------------------------------------------------------------------------
def rank_slice(n: int, rank: int | None = None, world_size: int | None = None) -> slice:
    """This rank's contiguous share of ``n`` items: rank r takes [r*n/W, (r+1)*n/W).

    Contiguous (not strided) so that whole GRPO groups stay on one rank when ``n`` is a multiple of
    ``world_size * group_size``. Uneven ``n`` is refused: the global batch must split exactly or the
    1-process and N-process runs would not see the same data.
    """
    rank = get_rank() if rank is None else rank
    world_size = get_world_size() if world_size is None else world_size
    if n % world_size:
        raise BadInputError(f"{n} items cannot be split evenly over {world_size} processes")
    per = n // world_size
    return slice(rank * per, (rank + 1) * per)


def shard_for_rank(items: Sequence[Any], rank: int | None = None, world_size: int | None = None) -> list[Any]:
    return list(items[rank_slice(len(items), rank, world_size)])


# --- collectives ---------------------------------------------------------------------------------------
def reduce_dtypes(backend: Backend) -> frozenset[torch.dtype] | None:
    """The torch dtypes ``backend``'s collective library reduces (None: all), from its declaration."""
    import torch

    names = getattr(backend, "collective_reduce_dtypes", None)
    if not names:
        return None
    dtypes = {n: getattr(torch, n, None) for n in names}
    unknown = sorted(n for n, d in dtypes.items() if not isinstance(d, torch.dtype))
    if unknown:
        raise BadInputError(f"backend {backend.name!r}: collective_reduce_dtypes names no torch dtype: {unknown}")
    return frozenset(dtypes.values())


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (sum | max | min | avg) over the default group; identity without one.

    A dtype the backend's collective library does not reduce (``Backend.collective_reduce_dtypes``: HCCL has no
    float64 before Ascend 950) never reaches its all-reduce: it is reduced through a gather instead
    (:func:`_all_reduce_by_gather_`), with the same result. Callers keep their float64 sums and counts."""
    import torch.distributed as dist

    if not is_distributed():
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in (*ops, "avg"):
        raise ValueError(f"all_reduce_: unknown op {op!r} (sum | max | min | avg)")
    work = _on_comm_device(tensor)
    if _reduce_dtypes is not None and work.dtype not in _reduce_dtypes:
        _all_reduce_by_gather_(work, op)
    elif op == "avg":
        dist.all_reduce(work, op=dist.ReduceOp.SUM)
        work.div_(dist.get_world_size())
    else:
        dist.all_reduce(work, op=ops[op])
    if work is not tensor:
        tensor.copy_(work)
    return tensor


# Same-width integer dtypes that carry a float's bits through a gather unchanged (a gather moves bytes; HCCL's
# all-gather takes every dtype, but an integer carrier keeps even that assumption out of the way).
_BIT_CARRIERS = {"float64": "int64", "float32": "int32", "float16": "int16", "bfloat16": "int16"}


def _all_reduce_by_gather_(tensor: torch.Tensor, op: str) -> None:
    """All-reduce ``tensor`` in place without a reduction of its dtype: every rank gathers every rank's exact
    bits and reduces them itself, in rank order, in the tensor's own dtype.

    Why not a float32 (hi, lo) pair: a pair carries 48 significant bits, not float64's 53, and the all-reduce
    of the hi parts rounds in float32, so it is exact only for small integers. The gather is exact for every
    value: the sum of two ranks is bit-identical to a float64 all-reduce (addition commutes), and with more
    ranks it differs from one only by summation order (within a few float64 ulps). Every rank computes the same
    sum from the same bits in the same order, so the ranks agree bit for bit. The cost is world_size copies of
    the tensor, nothing for the scalars and small metric vectors reduced this way."""
    import torch
    import torch.distributed as dist

    flat = tensor.detach().reshape(-1).contiguous()
    carrier = _BIT_CARRIERS.get(str(flat.dtype).removeprefix("torch."))
    sent = flat.view(getattr(torch, carrier)) if carrier else flat
    parts = [torch.empty_like(sent) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, sent)
    values = [p.view(flat.dtype) for p in parts]
    if op in ("max", "min"):
        out = torch.stack(values).amax(0) if op == "max" else torch.stack(values).amin(0)
    else:
        out = values[0].clone()
        for v in values[1:]:  # rank order: the same additions on every rank
            out += v
        if op == "avg":
            out /= len(values)
    tensor.copy_(out.view_as(tensor))


def _on_comm_device(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` where the backend's collective library wants it (``Backend.comm_device``: the accelerator
    for nccl/hccl, the host for gloo). Callers pass tensors wherever they have them, host scalars included."""
    if _comm_device is None or tensor.device == _comm_device:
        return tensor
    return tensor.to(_comm_device)


def all_reduce_metrics(
    metrics: Mapping[str, float], *, op: str = "avg", device: Any = None, ops: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Reduce a flat dict of scalars over ranks: one fp64 all-reduce per distinct op (``all_reduce_``: through a
    gather where the backend's collective library has no fp64 reduction).

    ``ops`` overrides the reduction per key (e.g. ``{"time/step_s": "max"}``). Every rank must pass the
    same keys (sorted here so the tensor layout matches). Returns plain floats on every rank.
    """
    import torch

    if not is_distributed():
        return {k: float(v) for k, v in metrics.items()}
    ops = ops or {}
    keys = sorted(metrics)
    out: dict[str, float] = {}
    for reduce_op in sorted({ops.get(k, op) for k in keys}):
        group = [k for k in keys if ops.get(k, op) == reduce_op]
        t = torch.tensor([float(metrics[k]) for k in group], dtype=torch.float64, device=device)
        all_reduce_(t, reduce_op)
        out.update(zip(group, t.tolist()))
    return out


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's Python object, in rank order, on every rank (``[obj]`` in a single process).

    For rollout records (token ids, scores): the trainer gathers a generation batch so that decisions over
    the global batch (DAPO's group filter) are taken identically on every rank.
    """
    import torch.distributed as dist

    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s Python object on every rank (small objects only: paths, decisions, steps)."""
    import torch.distributed as dist

    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# --- logging -------------------------------------------------------------------------------------------
class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = get_rank()
        return True


def setup_rank_logging(level: int = logging.INFO, *, all_ranks: bool = False) -> None:
    """Log lines carry ``[rank R]``; only rank 0 logs below WARNING unless ``all_ranks``."""
    handler = logging.StreamHandler()
    handler.addFilter(_RankFilter())
    handler.setFormatter(logging.Formatter("[rank %(rank)s] %(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("polyrl")
    for old in [h for h in root.handlers if getattr(h, "_polyrl_rank", False)]:
        root.removeHandler(old)
    handler._polyrl_rank = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level if (all_ranks or get_rank() == 0) else max(level, logging.WARNING))
