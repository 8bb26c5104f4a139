"""The memory plan of a run: what one device holds, counted from the recipe before anything runs.

``polyrl run RECIPE --dry-run`` calls :func:`plan_memory`. It never touches a device and never downloads: the
architecture comes from the checkpoint's ``config.json`` (a local directory) or from a preset, the model is
built on the ``meta`` device (shapes only, no storage) to count parameters exactly, and the backend is looked
up by name without its hardware (``Backend.device_memory_gib`` gives the memory of one device from a table).

What is counted, per device, for FSDP2 over ``world = nproc x nnodes`` processes (docs/recipes.md, "Memory
plan"): parameters in the recipe's dtype (sharded: 1/world each; the sharded copy is the optimizer's master),
gradients (same), Adam(W)'s two states (same dtype as the parameters: torch keeps them like the parameter),
the gathered layers (FSDP2 holds the root unit — embeddings, LM head — and two decoder layers unsharded in
the backend's compute dtype while they run), the reference model (KL) and the critic (GAE), activations
saved for backward at the token budget of one micro-batch, the log-prob path (full [T, V] logits, or the
fused op's fp32 tiles, ``model.fused_logprobs``), and the rollout: the hf engine's KV cache and prefill logits,
or an engine with its own weights and share of the device (vLLM, polyrl.core.plan.rollout).

Activation bytes per token and layer are linear in the architecture's dimensions; the coefficients below were
measured on the CPU (saved-tensor hooks over one decoder layer, bf16 and fp32, several widths; the test
``tests/plan/test_plan.py`` re-measures one). Everything else is exact arithmetic on shapes. The plan is a
model, not a measurement: peaks from allocator fragmentation and temporaries are covered by ``HEADROOM``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING, Any

from polyrl.core.config import RunConfig
from polyrl.core.data.packing import micro_batch_token_bound, packs_documents
from polyrl.core.distributed.sharding import sharding_policy
from polyrl.core.dtypes import compute_dtype
from polyrl.core.errors import BadInputError
from polyrl.core.models.lm_head import uses_fused_logprobs, uses_fused_loss
from polyrl.core.plan.rollout import vllm_plan
from polyrl.core.plan.rows import KNOBS, LABELS, PlanRows

if TYPE_CHECKING:
    from polyrl.core.plugins.backend import Backend

GIB = 2**30
# Fraction of a device's memory the plan lets a run use: the rest is the runtime's context, the collective
# library's buffers and allocator fragmentation.
HEADROOM = 0.90
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --- the architecture, on the meta device ---------------------------------------------------------------------
def architecture_config(cfg: RunConfig, name: str | None = None, overrides: dict | None = None) -> tuple[Any, str]:
    """The transformers config of ``name`` (default: the actor) and where it came from, without weights.

    A local directory: its config.json. A preset: its table entry. Anything else: ``model.preset`` (the
    architecture a dry run plans with before the checkpoint is downloaded), said in the returned note.
    """
    from polyrl.core.models.presets import PRESETS, check_overrides, model_config

    name = cfg.model.name if name is None else name
    overrides = dict(cfg.model.overrides if overrides is None else overrides)
    try:
        if os.path.isdir(name):
            from transformers import AutoConfig

            from polyrl.core.models.checkpoint_formats import read_format, strip_quantization

            quantized = read_format(name)  # a foreign quantization: refused here as in a run
            config = strip_quantization(AutoConfig.from_pretrained(name, local_files_only=True))
            check_overrides(type(config), overrides, f"checkpoint {name!r}")
            for key, value in overrides.items():
                setattr(config, key, value)
            loads = f": {quantized.describe(cfg.model.dtype)}" if quantized else ""
            return config, f"checkpoint {name}{loads}"
        if name in PRESETS:
            return model_config(name, **overrides), f"preset {name}"
        if cfg.model.preset is not None:
            return model_config(cfg.model.preset, **overrides), (
                f"model.name {name} is absent: architecture from preset {cfg.model.preset}")
    except (ValueError, OSError) as exc:
        raise BadInputError(f"model: {exc}") from None
    raise BadInputError(f"model.name: {name!r} is neither a local checkpoint directory nor a preset; "
                        "set model.preset to plan without the checkpoint")


@dataclasses.dataclass(frozen=True)
class ModelCount:
    """Parameter counts of one model, from a meta-device build."""

    total: int
    largest_layer: int  # the largest decoder layer (one FSDP2 unit)
    root: int  # what is not in a decoder layer: embeddings, final norm, LM head
    layers: int
    # the routed experts' parameters (fused 3-D [E, ...] tensors) of each decoder layer (0 for a dense layer)
    layer_experts: tuple[int, ...] = ()
    num_experts: int = 0  # experts of an MoE layer (0: none)
    layer_params: tuple[int, ...] = ()  # parameters of each decoder layer

    def gathered_layer(self, ep: int = 1) -> int:
        """Parameters of the largest decoder layer as FSDP2 gathers it: everything, except that with expert
        parallelism over ``ep`` ranks a rank gathers only its ``1/ep`` of the layer's experts."""
        if not self.layer_experts:
            return self.largest_layer
        return max(n - e + e // ep for n, e in zip(self.layer_params, self.layer_experts))


# Meta-device models by config (JSON text): a placement search plans the same architecture many times.
_META_MODELS: dict[str, Any] = {}
_COUNTS: dict[tuple[str, bool], ModelCount] = {}


def _config_key(config: Any) -> str:
    return config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)


def meta_model(config: Any) -> Any:
    """The causal LM of ``config`` on the meta device: shapes and structure, no storage, no download (kept for
    the next call with the same config; callers only read it)."""
    import torch
    from transformers import AutoModelForCausalLM

    key = _config_key(config)
    if key not in _META_MODELS:
        if len(_META_MODELS) >= 4:
            _META_MODELS.pop(next(iter(_META_MODELS)))
        with torch.device("meta"):
            _META_MODELS[key] = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return _META_MODELS[key]


def count_parameters(config: Any, *, lm_head: bool = True, model: Any = None) -> ModelCount:
    """Count the parameters of the causal LM of ``config`` (``model``: its :func:`meta_model`, built here when
    None). ``lm_head=False``: the critic's trunk (its LM head is replaced by a value head of H + 1 parameters)."""
    from polyrl.core.distributed.expert_parallel import experts_modules
    from polyrl.core.distributed.sharding import decoder_layers

    key = (_config_key(config), lm_head)
    if key in _COUNTS:
        return _COUNTS[key]
    model = meta_model(config) if model is None else model
    total = sum(p.numel() for p in model.parameters())
    layers = decoder_layers(model)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    experts = [[m for _, _, m in experts_modules(layer)] for layer in layers]
    per_layer_experts = tuple(sum(p.numel() for m in ms for p in m.parameters()) for ms in experts)
    num_experts = max((int(m.num_experts) for ms in experts for m in ms), default=0)
    if not lm_head:
        head = model.get_output_embeddings()
        shared = head is not None and head.weight is model.get_input_embeddings().weight
        if head is not None and not shared:
            total -= sum(p.numel() for p in head.parameters())
        total += config.hidden_size + 1
    _COUNTS[key] = ModelCount(total=total, largest_layer=max(per_layer, default=0), root=total - sum(per_layer),
                              layers=len(per_layer), layer_experts=per_layer_experts, num_experts=num_experts,
                              layer_params=tuple(per_layer))
    return _COUNTS[key]


# --- activations per token and layer ------------------------------------------------------------------------------
def _layer_types(config: Any) -> list[str]:
    """One entry per decoder layer: "sliding", "full" (GPT-OSS), "dense", "moe" (DeepSeek-V3)."""
    n = config.num_hidden_layers
    if config.model_type == "deepseek_v3":
        k = getattr(config, "first_k_dense_replace", 0)
        return ["dense" if i < k else "moe" for i in range(n)]
    types = getattr(config, "layer_types", None) or ["full_attention"] * n
    return ["sliding" if t == "sliding_attention" else "full" for t in types[:n]]


def activation_bytes_per_token(config: Any, kind: str, c: int, native_attention: bool) -> float:
    """Bytes saved for backward per token by one decoder layer of ``kind`` with compute dtype of ``c`` bytes.

    Coefficients measured on the CPU (module docstring) for GPT-OSS and DeepSeek-V3; other architectures get a
    generic dense-decoder estimate (not measured). The attention's saved output and its fp32 copy of q
    (GPT-OSS) / v (DeepSeek-V3) are fp32 in the exact reference and in the compute dtype in a native kernel.
    """
    H = config.hidden_size
    Hq = config.num_attention_heads
    attn_big = (c if native_attention else 4) * 2  # bytes per element of the two [T, Hq, Dv] tensors
    if config.model_type == "gpt_oss":
        D, Hkv, k, inter = config.head_dim, config.num_key_value_heads, config.num_experts_per_tok, config.intermediate_size
        elems = 2 * H + 2 * k * H + 7 * k * inter + 2 * Hkv * D + 43
        fp32 = 16 * H + 2 * Hq + 131
        return c * elems + fp32 + attn_big * Hq * D
    if config.model_type == "deepseek_v3":
        ql = config.q_lora_rank or 0
        kv, r, n, vd = config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim
        attn_elems = 2 * ql + 2 * kv + 3 * Hq * (n + r) - 16 * Hq
        attn_fp32 = 4 * ql + 4 * kv - 4 * r + 4 * Hq + attn_big * Hq * vd
        if kind == "dense":
            elems = 4 * H + 4 * config.intermediate_size + 64
            fp32 = 8 * H + 24
        else:
            k, mI, s = config.num_experts_per_tok, config.moe_intermediate_size, config.n_shared_experts or 0
            elems = 2 * H + 2 * k * H + 4 * k * mI + 4 * s * mI + 100
            fp32 = 15 * H + 16 * config.n_routed_experts + 6 * Hq
        return c * (elems + attn_elems) + fp32 + attn_fp32
    # Any other decoder (Llama-like, dense SwiGLU): the DeepSeek-V3 dense layer's MLP and norms, a GQA attention.
    D = getattr(config, "head_dim", None) or H // Hq
    Hkv = getattr(config, "num_key_value_heads", None) or Hq
    elems = 4 * H + 4 * config.intermediate_size + 2 * Hq * D + 2 * Hkv * D + 64
    return c * elems + 8 * H + 4 * Hq + attn_big * Hq * D


def kv_cache_bytes_per_token(config: Any, c: int) -> list[tuple[str, float]]:
    """Per decoder layer: (kind, bytes of cached keys and values per token) of transformers' DynamicCache.
    GPT-OSS caches K and V per KV head; DeepSeek-V3 (transformers) caches the decompressed per-head K and V."""
    if config.model_type == "deepseek_v3":
        per = c * config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    else:
        Hq = config.num_attention_heads
        D = getattr(config, "head_dim", None) or config.hidden_size // Hq
        per = c * 2 * (getattr(config, "num_key_value_heads", None) or Hq) * D
    return [(kind, per) for kind in _layer_types(config)]


# --- the plan ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class MemoryPlan:
    backend: str
    device: str
    device_memory_gib: float
    nproc: int
    nnodes: int
    world_size: int
    sharded: bool
    engine: str  # the rollout engine, as the trainer resolves rollout.engine
    architecture: str
    attention: str
    logprob_path: str
    params: dict[str, int]  # model -> parameter count
    rows: PlanRows  # item -> GiB per device
    phases: dict[str, float]  # phase -> GiB per device at its peak
    notes: list[str]
    # why the rollout engine cannot start whatever the rest holds (vLLM: its own weights overflow its share)
    engine_problem: str = ""

    @property
    def peak_gib(self) -> float:
        return max(self.phases.values())

    @property
    def usable_gib(self) -> float:
        return HEADROOM * self.device_memory_gib

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.usable_gib and not self.engine_problem

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(peak_gib=round(self.peak_gib, 3), usable_gib=round(self.usable_gib, 3), fits=self.fits,
                   headroom=HEADROOM)
        out["rows"] = {k: round(v, 3) for k, v in self.rows.items()}  # label -> GiB, in the printed order
        out["phases"] = {k: round(v, 3) for k, v in self.phases.items()}
        return out

    def text(self) -> str:
        lines = [
            f"memory plan: {self.backend} ({self.device}, {self.device_memory_gib:g} GiB per device), "
            f"{self.world_size} device(s) = {self.nproc} x {self.nnodes} node(s), "
            f"{'FSDP2-sharded' if self.sharded else 'not sharded'}",
            f"  architecture: {self.architecture}; attention: {self.attention}; log-probs: {self.logprob_path}; "
            f"rollout engine: {self.engine}",
            "  parameters: " + ", ".join(f"{k} {v / 1e9:.2f} B" for k, v in self.params.items()),
        ]
        width = max(len(k) for k in self.rows)
        lines += [f"  {k:<{width}}  {v:9.2f} GiB" for k, v in self.rows.items()]
        lines += [f"  peak in {k:<{width - 8}}  {v:9.2f} GiB" for k, v in self.phases.items()]
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"  peak {self.peak_gib:.2f} GiB of {self.usable_gib:.2f} GiB usable "
                     f"({HEADROOM:.0%} of {self.device_memory_gib:g}): {verdict}")
        if self.engine_problem:
            lines.append(f"  rollout engine does NOT fit: {self.engine_problem}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def advice(self) -> str:
        """One line: what to change so that the placement fits."""
        if self.engine_problem and self.peak_gib <= self.usable_gib:
            return f"memory plan: {self.engine_problem}"
        need = self.peak_gib
        # Sharded state shrinks with the world size; what does not (activations, gathered layers, rollout) stays.
        state = self.rows.sharded_gib() if self.sharded or self.world_size == 1 else 0.0
        fixed = need - state
        tips = []
        if state > 0 and fixed < self.usable_gib:
            devices = math.ceil(state * self.world_size / (self.usable_gib - fixed))
            tips.append(f"use at least {devices} devices (--nproc/--nnodes)")
        biggest = self.rows.largest_fixed()
        tips.append(f"shrink the largest item '{LABELS[biggest]}' ({getattr(self.rows, biggest):.1f} GiB: "
                    f"{KNOBS.get(biggest, 'the plan above shows what each row counts')})")
        return (f"memory plan: needs {need:.1f} GiB per device, {self.usable_gib:.1f} GiB usable on "
                f"{self.device} ({self.backend}) with {self.world_size} device(s): " + "; or ".join(tips))


def _rollout_engine(cfg: RunConfig, backend: Backend) -> tuple[str, str]:
    """(engine, note): the engine the trainer would run (``resolve_engine``, its own rule). A plan may be made
    where the backend's hardware or the engine's package is absent: a named engine that cannot run here is
    planned anyway (said in the note), an unknown one is refused as the trainer refuses it."""
    from polyrl.core.rollout import engine_names, resolve_engine

    requested = cfg.rollout.engine
    try:
        engine = resolve_engine(requested, backend)
    except BadInputError as exc:
        declared = tuple(backend.rollout_engines)
        fallback = requested if requested != "auto" else (declared[0] if declared else "")
        if fallback not in engine_names():
            raise
        return fallback, f"rollout engine {fallback}: cannot run on this machine ({exc}); planned as where it can"
    how = "the backend's first engine that can run on this machine" if requested == "auto" else "named"
    return engine, f"rollout engine {engine} (rollout.engine={requested}: {how})"


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """What every item of the plan is computed from: the world, the dtypes' bytes, the architecture."""

    world: int
    sharded: bool
    offload: bool
    ep: int
    s: int  # bytes of the storage dtype (model.dtype): parameters, gradients, optimizer states
    c: int  # bytes of the compute dtype (polyrl.core.dtypes.compute_dtype)
    red: int  # bytes of the gradient reduction dtype
    tokens: int  # one micro-batch's token bound (the trainer's packing rule)
    longest: int  # the longest sequence: prompt + response

    def share(self, n: int) -> float:
        return math.ceil(n / self.world) if self.sharded else n


def plan_memory(cfg: RunConfig, backend: Backend, *, nproc: int = 1, nnodes: int = 1,
                device_memory_gib: float | None = None, vocab_size: int | None = None) -> MemoryPlan:
    """The per-device memory plan of ``cfg`` on ``backend`` with ``nproc`` processes on each of ``nnodes``
    nodes. ``device_memory_gib`` overrides the backend's table; ``vocab_size`` is the tiny tokenizer's size
    for synthetic tasks (the trainer resizes the embeddings to it)."""
    if nproc < 1 or nnodes < 1:
        raise BadInputError(f"--nproc and --nnodes must be >= 1, got {nproc} and {nnodes}")
    world = nproc * nnodes
    if device_memory_gib is not None:
        device, capacity = "given", float(device_memory_gib)
    else:
        device, capacity = backend.placement.device_memory_gib(local_world_size=nproc)
    if capacity <= 0:
        raise BadInputError(f"device memory must be > 0 GiB, got {capacity}")
    policy = sharding_policy(backend, cfg.sharding)
    sharded = world > 1 and cfg.sharding.enabled
    s = _DTYPE_BYTES[cfg.model.dtype]  # storage: parameters, gradients, optimizer states
    c = _DTYPE_BYTES.get(compute_dtype(cfg.model.dtype, policy.param_dtype, sharded=sharded), s)
    red = _DTYPE_BYTES.get(policy.reduce_dtype, 4) if sharded else s
    overrides = dict(cfg.model.overrides)
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    config, source = architecture_config(cfg, overrides=overrides)
    if getattr(config, "pad_token_id", None) is not None and config.pad_token_id >= config.vocab_size:
        config.pad_token_id = 0  # as the trainer does for a task's tiny vocabulary
    actor_model = meta_model(config)
    actor = count_parameters(config, model=actor_model)
    notes = [f"architecture from {source}"] if not source.startswith("model.name") else [source]
    engine, engine_note = _rollout_engine(cfg, backend)
    notes.append(engine_note)
    if config.model_type not in ("gpt_oss", "deepseek_v3"):
        notes.append(f"activations of {config.model_type}: a generic dense-decoder estimate (not measured)")
    ep = cfg.sharding.expert_parallel if sharded else 1
    if ep > 1:
        if not actor.num_experts:
            raise BadInputError(f"sharding.expert_parallel={ep}: {config.model_type} has no MoE experts to split")
        if actor.num_experts % ep or world % ep:
            raise BadInputError(f"sharding.expert_parallel={ep} must divide the number of experts "
                                f"({actor.num_experts}) and the world size ({world})")
        notes.append(f"expert parallelism: groups of {ep} ranks, {actor.num_experts // ep} of {actor.num_experts} "
                     f"experts per device and MoE layer, FSDP2 over {world // ep} for the experts")
    longest = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    z = _Sizes(world=world, sharded=sharded, offload=cfg.sharding.cpu_offload and sharded, ep=ep, s=s, c=c, red=red,
               tokens=micro_batch_token_bound(cfg.algorithm.micro_batch_tokens, longest), longest=longest)

    params, state, static, critic_cfg = _state_rows(cfg, config, actor, overrides, z)
    lora_extra: dict[str, float] = {}
    if cfg.model.lora.enabled:  # frozen base, fp32 adapters, no reference copy (polyrl.core.plan.lora)
        from polyrl.core.plan.lora import lora_rows

        lora_extra, static = lora_rows(cfg, actor_model, actor.layers, state, params, engine, world, sharded, s, c,
                                       notes)
    update, attention, logprob_path = _update_rows(cfg, backend, config, actor_model, critic_cfg, z, notes)
    rollout, engine_problem = _rollout_rows(cfg, backend, engine, config, actor, state["gathered_layers"],
                                            capacity, z, notes)
    rows = PlanRows(**state, **update, **rollout.rows, **lora_extra)
    return MemoryPlan(
        backend=backend.name, device=device, device_memory_gib=capacity, nproc=nproc, nnodes=nnodes,
        world_size=world, sharded=sharded, engine=engine,
        architecture=f"{config.model_type}, {actor.layers} layers, vocab {config.vocab_size}"
        + (", activation checkpointing" if cfg.trainer.activation_checkpointing else ""),
        attention=attention, logprob_path=logprob_path, params=params, rows=rows,
        phases=_phases(rows, static, rollout, z, critic=critic_cfg is not None), notes=notes,
        engine_problem=engine_problem,
    )


def _state_rows(cfg: RunConfig, config: Any, actor: ModelCount, overrides: dict, z: _Sizes,
                ) -> tuple[dict[str, int], dict[str, float], float, Any]:
    """(parameter counts, the state rows in GiB, the GiB held through the whole step, the critic's config or
    None): the actor's parameters, gradients and Adam states, the reference model, the critic, FSDP2's gathered
    layers."""
    params = {"actor": actor.total}
    state_bytes = 0.0 if z.offload else z.share(actor.total) * z.s * 4  # params + grads + 2 Adam states
    rows: dict[str, float] = {}
    rows["parameters"] = 0.0 if z.offload else z.share(actor.total) * z.s / GIB
    rows["gradients"] = rows["parameters"]
    rows["optimizer_state"] = 2 * rows["parameters"]
    gathered = 0.0
    if z.sharded:
        layers_held = actor.layers if not cfg.sharding.reshard_after_forward else 2
        # with expert parallelism a rank gathers only its own experts (FSDP2 over world / ep)
        layer = actor.gathered_layer(z.ep)
        gathered = (actor.root + layers_held * layer) * z.c
        # gradients of a layer in backward before their reduce-scatter (compute dtype + the reduce dtype)
        gathered += layer * (z.c + z.red)
    ref_bytes = 0.0
    if cfg.algorithm.use_kl_in_reward or cfg.algorithm.use_kl_loss:
        params["reference"] = actor.total
        ref_bytes = 0.0 if z.offload else z.share(actor.total) * z.s
    critic_state = 0.0
    critic_cfg = None
    if cfg.algorithm.adv_estimator == "gae":
        name = cfg.model.critic_name or cfg.model.name
        critic_cfg, _ = architecture_config(cfg, name, {**overrides, **cfg.model.critic_overrides})
        if getattr(critic_cfg, "pad_token_id", None) is not None and critic_cfg.pad_token_id >= critic_cfg.vocab_size:
            critic_cfg.pad_token_id = 0
        critic = count_parameters(critic_cfg, lm_head=False)
        params["critic"] = critic.total
        critic_state = 0.0 if z.offload else z.share(critic.total) * z.s * 4  # params + grads + 2 Adam states
    rows["reference_model"] = ref_bytes / GIB
    rows["critic_state"] = critic_state / GIB
    rows["gathered_layers"] = gathered / GIB
    return params, rows, (state_bytes + ref_bytes + critic_state) / GIB, critic_cfg


def _update_rows(cfg: RunConfig, backend: Backend, config: Any, actor_model: Any, critic_cfg: Any, z: _Sizes,
                 notes: list[str]) -> tuple[dict[str, float | None], str, str]:
    """(the update's rows in GiB, the attention line, the log-prob path line): activations of one micro-batch,
    the log-prob path, the expert exchange's buffers, the critic's activations."""
    packed = packs_documents(cfg.model.attn_implementation)
    native = "varlen_attention" in backend.introspection.provided_kernels() and packed
    attention = (f"polyrl ({'native kernel of ' + backend.name if native else 'exact reference'})"
                 if packed else cfg.model.attn_implementation)
    c, tokens, longest = z.c, z.tokens, z.longest
    per_layer = [activation_bytes_per_token(config, kind, c, native) for kind in _layer_types(config)]
    ckpt = cfg.trainer.activation_checkpointing
    if ckpt:  # only each layer's input stays saved; one layer at a time is recomputed in backward
        act = (len(per_layer) * config.hidden_size * c + max(per_layer)) * tokens
    else:
        act = sum(per_layer) * tokens
    act += tokens * config.hidden_size * (2 * c + 8)  # embeddings output, final norm (input, fp32 pair)
    if not packed:
        # eager / sdpa: padded rows, [Hq, S, S] scores and probabilities per sequence, each layer
        seqs = max(1, tokens // longest)
        act += config.num_hidden_layers * seqs * config.num_attention_heads * longest**2 * (c + 4)
        notes.append(f"attention {cfg.model.attn_implementation}: quadratic scores counted per layer")
    V = config.vocab_size
    response_tokens = tokens * cfg.rollout.max_response_length / longest
    chunk = cfg.trainer.logprob_chunk_size
    # model.fused_logprobs: the trainer's own rule, on the meta-device model (a refused "true" is refused here too)
    if uses_fused_logprobs(cfg.model.fused_logprobs, actor_model):
        from polyrl.core.algorithms.linear_logprobs import vocab_chunk_for

        vchunk = vocab_chunk_for(chunk, V, None)
        if uses_fused_loss(cfg.model.fused_loss, True, backend):
            import torch

            from polyrl.core.algorithms.linear_loss import dw_accumulator_dtype, fused_token_chunk

            # the loss's gradient in the forward: one token chunk's fp32 logits and their gradient (in place for
            # fp32), then dH [T, H] and the whole dW (fp32 where that fits the op's budget) held to the backward
            rows_c = fused_token_chunk(tokens, V, c, chunk)
            head = torch.empty(V, config.hidden_size, dtype=torch.float32 if c == 4 else torch.bfloat16, device="meta")
            acc = dw_accumulator_dtype(head).itemsize
            logits = rows_c * V * (4 + (c if c != 4 else 0)) + tokens * config.hidden_size * c
            if cfg.model.lora.enabled:  # the base lm_head is frozen: the op makes no dW
                held = "dH held to the backward; no dW: the lm_head is frozen under LoRA"
            else:
                logits += V * config.hidden_size * acc
                held = f"dH and a {'fp32' if acc == 4 else 'bf16/fp16'} dW held to the backward"
            logprob_path = (f"fused lm_head + log-prob with the loss's gradient in its forward (fp32 [{rows_c}, "
                            f"{V}] chunks; {held})")
        else:
            # one fp32 [chunk, vocab chunk] tile in forward and one in backward, and backward's fp32 dW block
            logits = 2 * chunk * vchunk * 4 + vchunk * config.hidden_size * 4
            logprob_path = f"fused lm_head + log-prob (fp32 [{chunk}, {vchunk}] tiles, no [T, V] logits)"
    else:
        # forward: [T, V] logits; the chunked log-prob keeps the response rows [N, V]; backward adds their
        # gradient and the [T, V] gradient of the logits, plus one fp32 [chunk, V] block
        logits = (tokens * V + 2 * response_tokens * V) * c + chunk * V * 4
        logprob_path = f"full logits [T, V] + chunked fp32 log-prob ({chunk} rows)"
    rows: dict[str, float | None] = {"activations": act / GIB}
    if z.ep > 1:
        # One MoE layer's exchange at a time: its k rows per token sorted for sending, received, grouped by local
        # expert, and the expert outputs on their way back; at balanced routing a rank receives as many rows as
        # it sends (an unbalanced router sends some rank more: up to ep times as many).
        k = int(getattr(config, "num_experts_per_tok", 1) or 1)
        rows["expert_buffers"] = 4 * tokens * k * config.hidden_size * c / GIB
        notes.append("expert all-to-all buffers: at balanced routing (one rank receives tokens x k rows per MoE "
                     "layer); an unbalanced router sends a rank more")
    rows["logprob_path"] = logits / GIB
    if critic_cfg is not None:  # the critic's update runs before the actor's: its own activations, no logits
        crit = [activation_bytes_per_token(critic_cfg, k, c, native) for k in _layer_types(critic_cfg)]
        crit_act = (len(crit) * critic_cfg.hidden_size * c + max(crit)) if ckpt else sum(crit)
        rows["critic_activations"] = crit_act * tokens / GIB
    return rows, attention, logprob_path


@dataclasses.dataclass
class _Rollout:
    rows: dict[str, float]  # PlanRows fields in GiB
    awake_gib: float  # what generation adds on the device
    resident_gib: float  # what the engine keeps on the device while the trainer updates


def engine_rows(cfg: RunConfig, world: int) -> int:
    """Sequences one generate call of a device holds, of ``world`` devices: its prompts x ``rollout.n``, or
    ``rollout.micro_batch_size`` when smaller (what an engine with its own KV cache sizes it for)."""
    rows = -(-cfg.data.batch_size // max(1, world)) * cfg.rollout.n
    micro = cfg.rollout.micro_batch_size
    return min(rows, micro) if micro > 0 else rows


def _rollout_rows(cfg: RunConfig, backend: Backend, engine: str, config: Any, actor: ModelCount, gathered: float,
                  capacity: float, z: _Sizes, notes: list[str]) -> tuple[_Rollout, str]:
    """(the rollout's rows and what it holds awake and asleep, why the engine cannot start or "")."""
    ro, data = cfg.rollout, cfg.data
    V = config.vocab_size
    if engine == "hf":  # the trainer's model generates: KV cache and logits of the sequences generated together
        per_device = math.ceil(data.batch_size / z.world) * ro.n
        together = engine_rows(cfg, z.world)
        kv = 0.0
        for kind, per_token in kv_cache_bytes_per_token(config, z.c):
            held = (min(z.longest, config.sliding_window)
                    if kind == "sliding" and getattr(config, "sliding_window", None) else z.longest)
            kv += together * held * per_token
        kv_gib = kv / GIB
        logits_gib = together * (data.max_prompt_length * V * z.c + 3 * V * 4) / GIB
        notes.append(f"rollout: {together} sequences generated together per device "
                     f"({per_device} per step; rollout.micro_batch_size bounds it)")
        rows = {"rollout_kv_cache": kv_gib, "rollout_prefill_logits": logits_gib}
        return _Rollout(rows, gathered + kv_gib + logits_gib, 0.0), ""
    if engine == "vllm":  # its own weights inside its share of the device (polyrl.core.plan.rollout)
        vllm = vllm_plan(backend, params=actor.total, dtype_bytes=z.s, capacity_gib=capacity,
                         kv_bytes_per_token=kv_cache_bytes_per_token(config, z.s),
                         window=getattr(config, "sliding_window", None), longest=z.longest,
                         rows=engine_rows(cfg, z.world), sleep_level=ro.sleep_level)
        notes.append(vllm.note)
        rows = {"engine_weights": vllm.weights_gib, "engine_reserved": vllm.share_gib}
        return _Rollout(rows, vllm.awake_gib, vllm.asleep_gib), vllm.problem
    # an engine of its own (a plugin's): what it reserves of the device, as its backend configures it
    options = backend.engines.rollout_engine_options(engine)
    fraction = options.get("gpu_memory_utilization")
    reserved = float(fraction) * capacity if fraction else 0.0
    notes.append(f"rollout engine {engine}: " + (
        f"reserves {fraction:g} of the device (weights + KV cache)" if fraction else
        "sizes its own memory (not counted here)"))
    # an engine that never sleeps keeps its memory through the update
    sleep = ro.sleep_level if ro.sleep_level is not None else options.get("sleep_level")
    resident = reserved if not sleep else 0.0
    return _Rollout({"engine_reserved": reserved}, reserved, resident), ""


def _phases(rows: PlanRows, static: float, rollout: _Rollout, z: _Sizes, *, critic: bool) -> dict[str, float]:
    """phase -> GiB per device at its peak: ``static`` (the state held through the step) plus what the phase
    adds."""
    resident = rollout.resident_gib
    buffers = rows.expert_buffers or 0.0
    phases = {
        "rollout": static - rows.gradients * (not z.offload) + rollout.awake_gib + (rows.lora_merged_weights or 0.0),
        "update": static + rows.gathered_layers + rows.activations + rows.logprob_path + resident + buffers
        + (rows.lora_expert_weights or 0.0),
    }
    # torch's foreach Adam(W) step holds one temporary the size of the parameters it updates (sqrt of exp_avg_sq):
    # the gradients' size (all parameters; with LoRA the adapters only)
    phases["optimizer step"] = static + rows.gradients + resident
    if critic:
        phases["critic update"] = static + rows.gathered_layers + (rows.critic_activations or 0.0) + resident + buffers
    return phases
