"""Building what a run needs from its config, before anything is written: task, tokenizer, models, optimizers,
the rollout engine and the learners (:func:`build_components`, once per ``Trainer``).

Every user mistake that can be caught here is raised as ``BadInputError`` (unknown task or model preset,
missing data file, a data row without its field), so ``polyrl run`` can exit 2 before it creates or
touches the run directory.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

import torch

from polyrl.core import algorithms as A
from polyrl.core.config import RunConfig
from polyrl.core.dtypes import torch_dtype
from polyrl.core.errors import BadInputError
from polyrl.core.models.lm_head import fused_kernel_for
from polyrl.core.rollout import build_engine, resolve_engine
from polyrl.core.trainer import sync
from polyrl.core.trainer.critic import ValueModel
from polyrl.core.trainer.experience import Rollout, sampling_params
from polyrl.core.trainer.schedule import build_scheduler
from polyrl.core.trainer.state import TrainerState
from polyrl.core.trainer.update import Learner


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
              backend: Any = None) -> torch.nn.Module:
    from polyrl.core.models import build_model

    try:
        model = build_model(
            name, vocab_size=vocab_size, attn_implementation=cfg.model.attn_implementation,
            experts_implementation=cfg.model.experts_implementation,
            dtype=torch_dtype(cfg.model.dtype, what="model.dtype"), overrides=overrides, seed=seed,
            backend=backend,  # the model's attention runs this backend's kernel, whatever the process's is
        )
    except ValueError as exc:  # unknown preset / config field: the recipe's fault
        raise BadInputError(f"model: {exc}") from None
    if cfg.trainer.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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


def _optimizer(params, cfg: RunConfig, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    o = cfg.optimizer
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, betas=tuple(o.betas), eps=o.eps, weight_decay=weight_decay)


def build_models(cfg: RunConfig, vocab_size: int | None, backend: Any, device: torch.device) -> Models:
    """Actor (+ frozen reference when a KL term is on, + critic for GAE), sharded when distributed.

    ``vocab_size``: the tiny tokenizer's size for synthetic tasks (embeddings sized to it), else None.
    """
    from polyrl.core.distributed.sharding import apply_sharding

    seed = cfg.trainer.seed
    vocab = vocab_size
    actor = _build_lm(cfg.model.name, cfg, vocab, dict(cfg.model.overrides), seed, backend).to(device)
    alg = cfg.algorithm
    ref = None
    if alg.use_kl_in_reward or alg.use_kl_loss:
        ref = copy.deepcopy(actor).eval().requires_grad_(False)
    critic = None
    if alg.adv_estimator == "gae":
        name = cfg.model.critic_name or cfg.model.name
        overrides = {**cfg.model.overrides, **cfg.model.critic_overrides}
        critic = ValueModel(_build_lm(name, cfg, vocab, overrides, seed + 1, backend)).to(device)
    actor = apply_sharding(actor, backend, cfg.sharding)
    if ref is not None:
        ref = apply_sharding(ref, backend, cfg.sharding)
    if critic is not None:
        critic = apply_sharding(critic, backend, cfg.sharding)
    o = cfg.optimizer
    sched_kw = dict(warmup_steps=o.warmup_steps, total_steps=cfg.trainer.total_steps, schedule=o.schedule,
                    min_lr_ratio=o.min_lr_ratio)
    optimizer = _optimizer(actor.parameters(), cfg, o.lr, o.weight_decay)
    critic_opt = _optimizer(critic.parameters(), cfg, o.critic_lr, o.critic_weight_decay) if critic else None
    return Models(
        actor=actor, ref=ref, critic=critic, optimizer=optimizer, scheduler=build_scheduler(optimizer, **sched_kw),
        critic_optimizer=critic_opt, critic_scheduler=build_scheduler(critic_opt, **sched_kw) if critic_opt else None,
    )


def build_kl_controller(cfg: RunConfig) -> Any:
    alg = cfg.algorithm
    if not alg.use_kl_in_reward:
        return None
    if alg.kl_ctrl == "adaptive":
        return A.AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon)
    return A.FixedKLController(alg.kl_coef)


def check_before_launch(cfg: RunConfig, backend: Any, world_size: int) -> None:
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
    engine: Any
    rollout: Rollout
    actor: Learner
    critic: Learner | None
    fused: Any  # the backend's fused lm_head + log-prob kernel, or None
    probe: list[list[int]]  # the sync probe's token sequences
    probe_dtype: str  # whose tolerance the probe uses


def build_components(cfg: RunConfig, backend: Any, device: torch.device) -> Components:
    """Task → tokenizer → models → resumable state → rollout engine → learners, in that order (the seeds drawn
    while building follow it)."""
    task = build_task(cfg)
    tokenizer = build_tokenizer(cfg, task)
    models = build_models(cfg, len(tokenizer) if task.vocab() else None, backend, device)
    state = TrainerState(cfg.trainer.seed, task, build_kl_controller(cfg), backend.generator)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # Packing needs an attention that splits documents by position_ids; others get padded rows.
    packed = cfg.model.attn_implementation == "polyrl"
    max_len = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    sampling = sampling_params(cfg, tokenizer.eos_token_id)
    engine = build_engine(resolve_engine(cfg.rollout.engine, backend), models.actor, pad_token_id=pad_id,
                          backend=backend, max_model_len=max_len, sampling=sampling)
    rollout = Rollout(task=task, tokenizer=tokenizer, engine=engine, sampling=sampling, sample_gen=state.sample_gen,
                      task_rng=state.task_rng, device=device)
    fused = fused_kernel_for(cfg.model.fused_logprobs, models.actor, backend)
    c = state.counters
    actor = Learner(models.actor, models.optimizer, state.shuffle_gen, c, packed, pad_id, backend.logprobs, fused)
    critic = (Learner(models.critic, models.critic_optimizer, state.shuffle_gen, c, packed, pad_id)
              if models.critic is not None else None)
    actor_cfg = getattr(models.actor, "config", None)
    probe = sync.probe_sequences(actor_cfg, int(getattr(actor_cfg, "vocab_size", 2)), max_len=max_len)
    # the bar of the lower precision among the model's dtype and the backend's FSDP compute dtype
    dtypes = {cfg.model.dtype, backend.sharding_policy().param_dtype}
    probe_dtype = "float32" if dtypes == {"float32"} else sorted(dtypes - {"float32"})[0]
    return Components(task, tokenizer, models, state, engine, rollout, actor, critic, fused, probe, probe_dtype)
