"""Building what a run needs from its config, before anything is written: task, tokenizer, models, optimizers,
the rollout engine and the learners (:func:`build_components`, once per ``Trainer``).

Every user mistake that can be caught here is raised as ``BadInputError`` (unknown task or model preset,
missing data file, a data row without its field), so ``polyrl run`` can exit 2 before it creates or
touches the run directory.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from polyrl.core import algorithms as A
from polyrl.core.config import RunConfig
from polyrl.core.data.packing import packs_documents
from polyrl.core.distributed.sharding import sharding_policy
from polyrl.core.dtypes import lowest_precision, torch_dtype
from polyrl.core.errors import BadInputError
from polyrl.core.models.lm_head import fused_kernel_for, uses_fused_loss
from polyrl.core.rollout import RolloutEngine, build_engine, choose_engine
from polyrl.core.trainer import sync
from polyrl.core.trainer.critic import ValueModel
from polyrl.core.trainer.experience import Rollout, sampling_params
from polyrl.core.trainer.schedule import build_scheduler
from polyrl.core.trainer.state import TrainerState
from polyrl.core.trainer.update import Learner

if TYPE_CHECKING:
    from polyrl.core.plugins.backend import Backend


def build_task(cfg: RunConfig) -> Any:
    from polyrl.core.tasks import get_task

    params = dict(cfg.data.task_params)
    if cfg.data.task == "math":
        if cfg.data.path is None:
            raise BadInputError("data.path: the math task needs a data file (parquet or jsonl)")
        params.setdefault("path", cfg.data.path)
        params.setdefault("prompt_key", cfg.data.prompt_key)
        params.setdefault("answer_key", cfg.data.answer_key)
        params.setdefault("max_response_tokens", cfg.rollout.max_response_length)
    try:
        return get_task(cfg.data.task, **params)
    except BadInputError as exc:
        # A task switched by an override keeps the recipe's parameters for the old task: say where they are.
        if cfg.data.task_params:
            raise BadInputError(f"{exc} (data.task_params = {cfg.data.task_params}; "
                                "override it, e.g. data.task_params={})") from None
        raise


def build_tokenizer(cfg: RunConfig, task: Any) -> Any:
    symbols = task.vocab()
    if symbols and cfg.model.tokenizer is None:
        from polyrl.core.models.tokenizer import build_tiny_tokenizer

        return build_tiny_tokenizer(symbols)
    source = cfg.model.tokenizer or cfg.model.name
    if not os.path.isdir(source):  # never the hub: a name that is not a local directory would be downloaded
        key = "model.tokenizer" if cfg.model.tokenizer else "model.name"
        raise BadInputError(f"{key}: {source!r} is not a local directory; this task needs the checkpoint's "
                            "tokenizer (polyrl never downloads: set it to the checkpoint directory)")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise BadInputError(f"model.tokenizer: cannot load a tokenizer from {source!r} ({exc})") from None


def _build_lm(name: str, cfg: RunConfig, vocab_size: int | None, overrides: dict, seed: int,
              backend: Backend | None = None, meta: bool = False,
              device: torch.device | None = None) -> torch.nn.Module:
    from polyrl.core.models import build_model

    try:
        model = build_model(
            name, vocab_size=vocab_size, attn_implementation=cfg.model.attn_implementation,
            experts_implementation=cfg.model.experts_implementation,
            dtype=torch_dtype(cfg.model.dtype, what="model.dtype"), overrides=overrides, seed=seed,
            backend=backend,  # the model's attention runs this backend's kernel, whatever the process's is
            meta=meta, device=device,
        )
    except ValueError as exc:  # unknown preset / config field: the recipe's fault
        raise BadInputError(f"model: {exc}") from None
    if cfg.trainer.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _with_adapters(model: torch.nn.Module, cfg: RunConfig, seed: int, meta: bool = False) -> torch.nn.Module:
    """The actor with ``model.lora``'s adapters (polyrl.core.models.lora), drawn from their own seeded generator
    (a meta skeleton draws nothing: every rank's global generator moves alike), kept in fp32 whatever the base's
    dtype (their Adam states too: a few percent of the model)."""
    from polyrl.core.models.lora import apply_lora

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        apply_lora(model, cfg.model.lora, low_cpu_mem_usage=meta)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


@dataclasses.dataclass
class Models:
    actor: torch.nn.Module
    ref: torch.nn.Module | None
    critic: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    critic_optimizer: torch.optim.Optimizer | None
    critic_scheduler: Any
    ref_is_actor: bool = False  # LoRA: the reference is the actor with its adapters off (``ref`` is None)

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module | None]:
        """The reference policy for the duration: the frozen copy, or (LoRA) the actor with its adapters off;
        None without a reference."""
        if not self.ref_is_actor:
            yield self.ref
            return
        from polyrl.core.models.lora import adapters_disabled

        with adapters_disabled(self.actor) as ref:
            yield ref


def _optimizer(params, cfg: RunConfig, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    o = cfg.optimizer
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, betas=tuple(o.betas), eps=o.eps, weight_decay=weight_decay)


def build_models(cfg: RunConfig, vocab_size: int | None, backend: Backend, device: torch.device) -> Models:
    """Actor (+ frozen reference when a KL term is on, + critic for GAE), sharded when distributed.

    ``vocab_size``: the tiny tokenizer's size for synthetic tasks (embeddings sized to it), else None.
    """
    from polyrl.core.distributed import loading
    from polyrl.core.distributed.sharding import apply_sharding

    seed = cfg.trainer.seed
    vocab = vocab_size
    alg = cfg.algorithm
    lora = cfg.model.lora.enabled
    ref_is_actor = lora and (alg.use_kl_in_reward or alg.use_kl_loss)
    with_ref = (alg.use_kl_in_reward or alg.use_kl_loss) and not lora
    critic_args = None
    if alg.adv_estimator == "gae":
        critic_args = (cfg.model.critic_name or cfg.model.name, {**cfg.model.overrides, **cfg.model.critic_overrides})
    if loading.builds_on_rank0(cfg.sharding):
        # Only rank 0 materialises the weights (on the host); the others build meta skeletons and receive their
        # shards from it (polyrl.core.distributed.loading). One model at a time, so rank 0 holds one full copy.
        meta = not loading.is_rank0()
        actor = _build_lm(cfg.model.name, cfg, vocab, dict(cfg.model.overrides), seed, backend, meta=meta)
        if lora:
            actor = _with_adapters(actor, cfg, seed, meta=meta)
        full = None if meta else actor.state_dict()
        ref = loading.meta_copy(actor).eval().requires_grad_(False) if with_ref else None
        actor = loading.shard_from_rank0(actor, full, backend, cfg.sharding, device)
        if ref is not None:
            ref = loading.shard_from_rank0(ref, full, backend, cfg.sharding, device)
        del full
        critic = None
        if critic_args is not None:
            # ValueModel draws its head from the global generator before zeroing it: built outside the meta
            # skeleton on every rank, so that every rank's generator moves as in the single-process build.
            critic = ValueModel(_build_lm(critic_args[0], cfg, vocab, critic_args[1], seed + 1, backend, meta=meta))
            critic = loading.shard_from_rank0(critic, None, backend, cfg.sharding, device)
    else:
        on = device if cfg.model.init_device == "device" else None  # model.init_device: drawn / loaded there
        actor = _build_lm(cfg.model.name, cfg, vocab, dict(cfg.model.overrides), seed, backend, device=on)
        with on or contextlib.nullcontext():
            actor = (_with_adapters(actor, cfg, seed) if lora else actor).to(device)
        ref = copy.deepcopy(actor).eval().requires_grad_(False) if with_ref else None
        critic = None
        if critic_args is not None:
            critic = ValueModel(_build_lm(critic_args[0], cfg, vocab, critic_args[1], seed + 1, backend)).to(device)
        actor = apply_sharding(actor, backend, cfg.sharding)
        if ref is not None:
            ref = apply_sharding(ref, backend, cfg.sharding)
        if critic is not None:
            critic = apply_sharding(critic, backend, cfg.sharding)
    o = cfg.optimizer
    sched_kw = dict(warmup_steps=o.warmup_steps, total_steps=cfg.trainer.total_steps, schedule=o.schedule,
                    min_lr_ratio=o.min_lr_ratio)
    # LoRA: only the adapters get gradients and optimizer states
    trainable = [p for p in actor.parameters() if p.requires_grad] if lora else actor.parameters()
    optimizer = _optimizer(trainable, cfg, o.lr, o.weight_decay)
    critic_opt = _optimizer(critic.parameters(), cfg, o.critic_lr, o.critic_weight_decay) if critic else None
    return Models(
        actor=actor, ref=ref, critic=critic, optimizer=optimizer, scheduler=build_scheduler(optimizer, **sched_kw),
        critic_optimizer=critic_opt, critic_scheduler=build_scheduler(critic_opt, **sched_kw) if critic_opt else None,
        ref_is_actor=ref_is_actor,
    )


def build_kl_controller(cfg: RunConfig) -> Any:
    alg = cfg.algorithm
    if not alg.use_kl_in_reward:
        return None
    if alg.kl_ctrl == "adaptive":
        return A.AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon)
    return A.FixedKLController(alg.kl_coef)


def check_before_launch(cfg: RunConfig, backend: Backend, world_size: int) -> None:
    """What the ``--nproc`` launcher refuses before any worker starts (bad input: one line, exit 2, from one
    process): the task and its data, the checkpoints' formats, the placement on ``world_size`` processes."""
    from polyrl.core.distributed.sharding import check_placement
    from polyrl.core.models.checkpoint_formats import check_formats

    build_task(cfg)
    check_formats(cfg.model.name, cfg.model.critic_name)
    check_placement(cfg, backend, world_size)


@dataclasses.dataclass
class Components:
    """What ``Trainer.__init__`` builds from the config (:func:`build_components`)."""

    task: Any
    tokenizer: Any
    models: Models
    state: TrainerState
    engine: RolloutEngine
    rollout: Rollout
    actor: Learner  # with the backend's log-prob kernels (``actor.linear_logprobs``: the fused one, or None)
    critic: Learner | None
    probe: list[list[int]]  # the sync probe's token sequences
    probe_dtype: str  # whose tolerance the probe uses
    engine_choice: str = ""  # which rollout engine and why (one line for the run log)
    precompiled: str = ""  # what the backend compiled ahead of the first step (one line for the run log; "" none)


def rollout_rows(cfg: RunConfig) -> int:
    """Sequences one generate call of this rank holds (this rank's prompts x ``rollout.n``, or
    ``rollout.micro_batch_size`` when smaller): what an engine with its own KV cache sizes it for."""
    from polyrl.core import distributed as D
    from polyrl.core.plan.memory import engine_rows

    return engine_rows(cfg, D.get_world_size())


def routing_replay_for(cfg: RunConfig, actor: torch.nn.Module, engine_name: str,
                       backend: Backend) -> tuple[Any, dict[str, Any]]:
    """``rollout.routing_replay``: the hooks on the actor's routers (None when off) and what the engine is built with
    (r3: ``return_routes=True``). Refused in one line, before the run starts, for a model routing replay does not
    know and for an engine that cannot return its routes (the factory's ``routes_refusal``)."""
    from polyrl.core.models.routing import install_router_replay, unsupported_moe
    from polyrl.core.plugins import get_registry

    mode = cfg.rollout.routing_replay
    if mode == "off":
        return None, {}
    problem = unsupported_moe(actor)
    if problem:
        raise BadInputError(f"rollout.routing_replay={mode}: model {cfg.model.name!r} cannot replay routes: {problem}")
    if mode == "r3":
        refuse = getattr(get_registry().rollout_engines.get(engine_name), "routes_refusal", None)
        why = refuse(backend) if callable(refuse) else "it does not say it can return the experts it routed to"
        if why:
            raise BadInputError(f"rollout.routing_replay=r3: rollout engine {engine_name!r} on backend "
                                f"{backend.name!r} cannot return routed experts: {why}")
    return install_router_replay(actor), ({"return_routes": True} if mode == "r3" else {})


def decode_option(cfg: RunConfig, engine_name: str, backend: Backend) -> dict[str, Any]:
    """``rollout.decode`` as the engine's options ({} for the engine's own decode); refused in one line, before the
    run starts, where an explicit mode cannot run: another engine than hf, ``graph`` on a backend without device
    graphs (``Backend.device_graph``), more than one process (FSDP2 gathers the weights inside every forward).
    ``auto`` takes ``graph`` where all of that holds and routing replay is not r3 (measured on an H100: the tiny
    DAPO recipe's wall 37.8 s -> 29.8 s), the engine's dynamic decode elsewhere (on 2 CPU cores the uncaptured
    static step is no faster; with LoRA merged for the rollout, every generate call swaps in new weight tensors,
    so a graph would be captured again each call), and falls back to dynamic if the capture fails."""
    from polyrl.core import distributed as D

    mode = cfg.rollout.decode
    if mode == "dynamic":
        return {}
    if engine_name != "hf":
        why = (f"rollout.decode={mode}: the {engine_name!r} engine decodes its own way; only the hf engine has this "
               "option")
    elif mode in ("auto", "graph") and backend.device_graph() is None:
        why = (f"rollout.decode=graph: backend {backend.name!r} cannot capture device graphs; use "
               "rollout.decode=static or dynamic")
    elif D.get_world_size() > 1:
        why = f"rollout.decode={mode} runs on one process; this run has {D.get_world_size()}"
    else:
        why = ""
    if mode != "auto":
        if why:
            raise BadInputError(why)
        return {"decode": mode}
    lora = cfg.model.lora
    if why or cfg.rollout.routing_replay == "r3" or (lora.enabled and lora.merge_for_rollout):
        return {}
    return {"decode": "graph", "graph_fallback": "dynamic"}


def start_precompile(cfg: RunConfig, backend: Backend, device: torch.device) -> Callable[[], str] | None:
    """``Backend.precompile`` with the attention layouts of the recipe's models (actor, and critic for GAE) read from
    their configs, in the dtypes their attention runs (the model's, and the sharded compute dtype when there are
    several processes). None when the models do not run polyrl's attention or a config cannot be read here
    (building the model then says what is wrong)."""
    from polyrl.core import distributed as D
    from polyrl.core.attention.layouts import attention_layouts
    from polyrl.core.models.build import model_config_for

    if cfg.model.attn_implementation != "polyrl":
        return None
    names = [(cfg.model.name, dict(cfg.model.overrides))]
    if cfg.algorithm.adv_estimator == "gae":
        names.append((cfg.model.critic_name or cfg.model.name, {**cfg.model.overrides, **cfg.model.critic_overrides}))
    try:
        layouts = list(dict.fromkeys(layout for name, overrides in names
                                     for layout in attention_layouts(model_config_for(name, overrides))))
    except (ValueError, OSError, TypeError, KeyError):  # refused, with its message, by build_models
        return None
    dtypes = [torch_dtype(cfg.model.dtype, what="model.dtype")]
    if D.get_world_size() > 1:
        dtypes.append(torch_dtype(sharding_policy(backend, cfg.sharding).param_dtype, what="sharding.param_dtype"))
    return backend.precompile(layouts, dtypes, device)


def build_components(cfg: RunConfig, backend: Backend, device: torch.device) -> Components:
    """Task → tokenizer → models → resumable state → rollout engine → learners, in that order (the seeds drawn
    while building follow it). The backend's kernels for the models' attention compile meanwhile
    (``start_precompile``), waited for before the engine is built."""
    precompiling = start_precompile(cfg, backend, device)
    try:
        task = build_task(cfg)
        tokenizer = build_tokenizer(cfg, task)
        models = build_models(cfg, len(tokenizer) if task.vocab() else None, backend, device)
        # the log-prob path, read off the built actor: refused here, before the engine is built, where it cannot run
        fused = fused_kernel_for(cfg.model.fused_logprobs, models.actor, backend)
        fused_loss = uses_fused_loss(cfg.model.fused_loss, fused is not None, backend)
    except BaseException:
        getattr(precompiling, "cancel", lambda: None)()  # the compiles not started yet are not waited for at exit
        raise
    precompiled = precompiling() if precompiling is not None else ""
    state = TrainerState(cfg.trainer.seed, task, build_kl_controller(cfg), backend.placement.generator)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    packed = packs_documents(cfg.model.attn_implementation)
    max_len = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    sampling = sampling_params(cfg, tokenizer.eos_token_id)
    actor_cfg = getattr(models.actor, "config", None)
    engine_name, engine_choice = choose_engine(cfg.rollout.engine, backend, actor_cfg)
    replay, engine_routes = routing_replay_for(cfg, models.actor, engine_name, backend)
    sleep = {} if cfg.rollout.sleep_level is None else {"sleep_level": cfg.rollout.sleep_level}
    decode = decode_option(cfg, engine_name, backend)
    if decode:
        engine_choice += f"; decode {decode['decode']} (rollout.decode={cfg.rollout.decode})"
    engine = build_engine(engine_name, models.actor, pad_token_id=pad_id, backend=backend, max_model_len=max_len,
                          sampling=sampling, max_num_seqs=rollout_rows(cfg), **engine_routes, **sleep, **decode)
    if cfg.model.lora.enabled and hasattr(engine, "merge_adapters"):  # the hf engine (polyrl.core.rollout.hf)
        engine.merge_adapters = cfg.model.lora.merge_for_rollout
    rollout = Rollout(task=task, tokenizer=tokenizer, engine=engine, sampling=sampling, sample_gen=state.sample_gen,
                      task_rng=state.task_rng, device=device)
    actor = Learner(models.actor, models.optimizer, state.shuffle_gen, packed, pad_id, backend.logprobs, fused,
                    replay=replay, linear_logprob_loss=backend.linear_logprob_loss if fused_loss else None)
    critic = (Learner(models.critic, models.critic_optimizer, state.shuffle_gen, packed, pad_id)
              if models.critic is not None else None)
    probe = sync.probe_sequences(actor_cfg, int(getattr(actor_cfg, "vocab_size", 2)), max_len=max_len)
    # The bar of the lowest precision among the model's dtype, the FSDP compute dtype (the recipe's
    # sharding.param_dtype where set, even in one process: the bar of the sharded run), the backend's own policy
    # dtype (kept where the recipe asks for more: an accelerator engine's float32 is not the trainer's, e.g. the
    # tiny GPT-OSS float32 vLLM engine on an H200 differs from the float32 trainer by up to 0.13 nats on the probe,
    # docs/rollout.md) and the engine's dtype (an engine may generate in its own).
    probe_dtype = lowest_precision(cfg.model.dtype, sharding_policy(backend, cfg.sharding).param_dtype,
                                   backend.placement.sharding_policy().param_dtype,
                                   str(getattr(engine, "dtype", cfg.model.dtype)))
    return Components(task, tokenizer, models, state, engine, rollout, actor, critic, probe, probe_dtype,
                      engine_choice, precompiled)
