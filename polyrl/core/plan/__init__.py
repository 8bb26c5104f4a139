"""Decisions taken about a run before it starts, from its recipe alone: today the memory plan of one device
(:mod:`.memory`, ``polyrl run --dry-run``). Nothing here touches a device or downloads.

Its place above the model and run layers: the plan counts what the trainer will build (the model on the
``meta`` device, the log-prob path, the rollout), so it reads those layers and nothing reads it but the CLI.
"""

from polyrl.core.plan.memory import (
    HEADROOM,
    MemoryPlan,
    ModelCount,
    activation_bytes_per_token,
    architecture_config,
    count_parameters,
    kv_cache_bytes_per_token,
    plan_memory,
)

__all__ = [
    "HEADROOM",
    "MemoryPlan",
    "ModelCount",
    "activation_bytes_per_token",
    "architecture_config",
    "count_parameters",
    "kv_cache_bytes_per_token",
    "plan_memory",
]
