"""The memory plan's LoRA terms (``model.lora``): what adapters change in what one device holds.

With adapters the base weights are frozen: the parameters row keeps the whole model (in the recipe's dtype)
plus the adapters (fp32), but gradients and Adam's two states exist for the adapters only (fp32), and there is
no reference copy (the reference is the actor with its adapters off). Two items are added:
- ``lora_expert_weights`` (update): peft's adapters on 3-D expert weights run the experts on ``W + delta``,
  materialised in the compute dtype for each adapted expert weight while its layer runs and saved for backward
  (the grouped matmul needs its weight for the input's gradient): every decoder layer's, or one layer's with
  activation checkpointing (the recomputed layer).
- ``lora_merged_weights`` (rollout, the hf engine on an unsharded model, ``model.lora.merge_for_rollout``): the
  merged copy of the adapted weights the engine generates with (polyrl.core.models.lora.merged_for_generation).
"""

from __future__ import annotations

import math
from typing import Any

from polyrl.core.config import RunConfig

GIB = 2**30
_ADAPTER_BYTES = 4  # adapters, their gradients and Adam states are fp32 (polyrl.core.trainer.setup)


def lora_rows(cfg: RunConfig, actor_model: Any, layers: int, state: dict[str, float], params: dict[str, int],
              engine: str, world: int, sharded: bool, storage_bytes: int, compute_bytes: int,
              notes: list[str]) -> tuple[dict[str, float], float]:
    """Rewrite ``state`` (GiB rows of polyrl.core.plan.memory._state_rows) for ``model.lora`` in place, add the
    trainable count to ``params``; returns (the added rows, the GiB held through the whole step)."""
    from polyrl.core.models.lora import adapter_count

    count = adapter_count(actor_model, cfg.model.lora)
    params["trainable (LoRA)"] = count.trainable
    params.pop("reference", None)

    def share(n: int) -> float:
        return math.ceil(n / world) if sharded else n

    offload = cfg.sharding.cpu_offload and sharded
    adapters = 0.0 if offload else share(count.trainable) * _ADAPTER_BYTES / GIB
    state["parameters"] = (0.0 if offload else share(params["actor"]) * storage_bytes / GIB) + adapters
    state["gradients"] = adapters
    state["optimizer_state"] = 2 * adapters
    state["reference_model"] = 0.0
    if cfg.algorithm.use_kl_in_reward or cfg.algorithm.use_kl_loss:
        notes.append("LoRA: the reference is the actor with its adapters off (no copy)")
    notes.append(f"LoRA: {count.trainable:,} trainable parameters (rank {cfg.model.lora.rank}) of "
                 f"{params['actor']:,}; gradients and Adam states for them only (fp32)")
    held = 1 if cfg.trainer.activation_checkpointing else layers
    extra = {"lora_expert_weights": held * count.experts_per_layer * compute_bytes / GIB}
    if engine == "hf" and not sharded and cfg.model.lora.merge_for_rollout:
        extra["lora_merged_weights"] = count.targeted * storage_bytes / GIB
    static = state["parameters"] + state["gradients"] + state["optimizer_state"] + state["critic_state"]
    return extra, static
