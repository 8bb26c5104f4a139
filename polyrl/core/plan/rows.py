"""The rows of a memory plan: what one device holds, item by item, in GiB — a typed record whose fields the plan
computes with, printed under the labels ``polyrl run --dry-run`` shows.

Each field is one item of the plan (polyrl.core.plan.memory's docstring says what it counts); an item that does
not apply to the run (no expert parallelism, the hf engine's rows under vLLM, ...) is None and not printed. The
record reads as a mapping from labels to GiB too (``rows["parameters"]``, ``"rollout KV cache" in rows``): the
order of the fields is the order of the printed plan and of ``--json``'s ``rows``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

from polyrl.core.plan.rollout import SHARE_ROW, WEIGHTS_ROW

# field -> label, in the printed order
LABELS: dict[str, str] = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state (2 Adam states)",
    "master_weights": "master weights",
    "reference_model": "reference model",
    "critic_state": "critic (params+grads+optimizer)",
    "gathered_layers": "gathered layers (FSDP2)",
    "activations": "activations (one micro-batch)",
    "expert_buffers": "expert all-to-all buffers",
    "logprob_path": "log-prob path (logits)",
    "critic_activations": "critic activations",
    "rollout_kv_cache": "rollout KV cache",
    "rollout_prefill_logits": "rollout prefill logits",
    "engine_weights": WEIGHTS_ROW,
    "engine_reserved": SHARE_ROW,
    "lora_expert_weights": "LoRA experts W + delta (update)",
    "lora_merged_weights": "LoRA merged weights (rollout)",
}
# The items that shrink as 1/world with more devices (FSDP2 shards them); the rest does not.
SHARDED: tuple[str, ...] = ("parameters", "gradients", "optimizer_state", "reference_model", "critic_state")

# What to change when an item that more devices do not shrink is the largest.
KNOBS: dict[str, str] = {
    "activations": "set trainer.activation_checkpointing=true or lower algorithm.micro_batch_tokens"
                   " (a sequence longer than the budget is a micro-batch of its own)",
    "critic_activations": "set trainer.activation_checkpointing=true or lower algorithm.micro_batch_tokens",
    "logprob_path": "set model.fused_logprobs=auto or lower algorithm.micro_batch_tokens",
    "rollout_kv_cache": "set rollout.micro_batch_size",
    "engine_reserved": "set rollout.engine=hf (generation on the trainer's model) or add devices",
    "engine_weights": "set rollout.engine=hf (generation on the trainer's model) or use devices with more memory",
    "rollout_prefill_logits": "set rollout.micro_batch_size or lower data.max_prompt_length",
    "gathered_layers": "keep sharding.reshard_after_forward=true; an MoE layer that does not fit gathered "
                       "needs sharding.expert_parallel (each rank gathers only its share of the experts)",
    "expert_buffers": "lower algorithm.micro_batch_tokens",
    "reference_model": "turn the KL terms off or add devices",
    "lora_expert_weights": "set trainer.activation_checkpointing=true (one layer's adapted experts at a time)",
    "lora_merged_weights": "set model.lora.merge_for_rollout=false (generation through the adapters, no copy)",
}
_FIELD = {label: field for field, label in LABELS.items()}


@dataclasses.dataclass
class PlanRows(Mapping[str, float]):
    """GiB per device, item by item (None: the item does not apply to this run)."""

    parameters: float  # the sharded parameters (the optimizer's master copy), in the recipe's dtype
    gradients: float
    optimizer_state: float  # Adam(W)'s two states, in the parameters' dtype
    reference_model: float  # KL: a frozen copy of the actor (0 without KL terms)
    critic_state: float  # GAE: the critic's parameters, gradients and optimizer states (0 without a critic)
    gathered_layers: float  # FSDP2's unsharded root and layers while they run, in the compute dtype
    activations: float  # saved for backward, one micro-batch at the token budget
    logprob_path: float  # the logits (or the fused op's tiles) of one micro-batch
    master_weights: float = 0.0  # the sharded parameters are the master copy: no separate one
    expert_buffers: float | None = None  # expert parallelism: one MoE layer's all-to-all rows
    critic_activations: float | None = None
    rollout_kv_cache: float | None = None  # the hf engine (the trainer's model generates)
    rollout_prefill_logits: float | None = None
    engine_weights: float | None = None  # an engine with its own weights (vLLM), inside its reserved share
    engine_reserved: float | None = None  # an engine's share of the device
    lora_expert_weights: float | None = None  # LoRA: adapted expert weights materialised for backward
    lora_merged_weights: float | None = None  # LoRA + hf engine: the merged copy generation runs on

    def present(self) -> dict[str, float]:
        """field -> GiB of the items that apply, in the printed order."""
        values = {f: getattr(self, f) for f in LABELS}
        return {f: v for f, v in values.items() if v is not None}

    def sharded_gib(self) -> float:
        """What more devices shrink (the sharded state at this world size)."""
        return sum(getattr(self, f) for f in SHARDED)

    def fixed(self) -> dict[str, float]:
        """label -> GiB of the items more devices do not shrink, those above 0."""
        return {LABELS[f]: v for f, v in self.present().items() if f not in SHARDED and v > 0}

    def largest_fixed(self) -> str:
        """The field of the largest item that more devices do not shrink."""
        present = {f: v for f, v in self.present().items() if f not in SHARDED}
        return max(present, key=lambda f: present[f])

    # --- a mapping from labels to GiB (the printed plan, --json, readers of 0.2's dict) ---
    def __getitem__(self, label: str) -> float:
        value = getattr(self, _FIELD[label]) if label in _FIELD else None
        if value is None:
            raise KeyError(label)
        return value

    def __iter__(self) -> Iterator[str]:
        return (LABELS[f] for f in self.present())

    def __len__(self) -> int:
        return len(self.present())
