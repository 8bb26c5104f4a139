"""Distributed execution: process groups and collectives, FSDP2 sharding, the local torchrun launcher.

- :mod:`.process_group` — SPMD helpers every rank calls (rank, world size, all-reduce of metrics, object
  gathers); a single process is a world of one, so callers never branch on whether they are distributed.
- :mod:`.sharding` — FSDP2 over a plain model, with the backend's sharding policy.
- :mod:`.launch` — ``polyrl run --nproc N``: re-runs the command as torchrun workers.
- :mod:`.process` — one process of a run around the trainer: OpenMP policy, determinism, exit paths.

``from polyrl.core import distributed as D`` gives the process-group helpers as ``D.get_rank()`` etc. They are
loaded on first use (PEP 562), so :mod:`.process` can set OpenMP's environment before anything imports torch.
"""

from typing import Any

__all__ = [
    "TORCHRUN_ENV",
    "DistContext",
    "all_gather_object",
    "all_reduce_",
    "all_reduce_metrics",
    "apply_env_defaults",
    "barrier",
    "broadcast_object",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_distributed",
    "is_main_process",
    "rank_slice",
    "setup_rank_logging",
    "shard_for_rank",
    "shutdown_distributed",
    "under_torchrun",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from polyrl.core.distributed import process_group

        return getattr(process_group, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
