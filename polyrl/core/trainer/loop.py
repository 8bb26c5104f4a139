"""The RL loop, top to bottom: rollout → reward → (critic values) → advantages → PPO updates → metrics.

``Trainer.step()`` is one training step and reads in that order; everything it needs is built once in
``Trainer.__init__`` (:mod:`polyrl.core.trainer.setup`), where every user mistake surfaces as
``BadInputError`` before a run directory exists. SPMD-ready: each rank takes its slice of the prompts,
token counts are all-reduced, metrics are averaged over ranks and written by rank 0. Resumable: the
mutable state lives in the models, optimizers, schedulers and ``TrainerState`` that ``checkpoint_state``
hands to :mod:`polyrl.core.run.checkpoint`.
"""

from __future__ import annotations

import math
import random
import time
import warnings
from typing import Any

import torch

from polyrl.core import algorithms as A
from polyrl.core import distributed as D
from polyrl.core.config import RunConfig
from polyrl.core.models.lm_head import fused_kernel_for
from polyrl.core.rollout import build_engine, resolve_engine
from polyrl.core.trainer import sync
from polyrl.core.trainer.batch import SequenceBatch, forward_all, policy_forward, value_forward
from polyrl.core.trainer.experience import Rollout, TrainingAborted, collect_experience, sampling_params
from polyrl.core.trainer.setup import build_kl_controller, build_models, build_task, build_tokenizer, check_config
from polyrl.core.trainer.state import TrainerState
from polyrl.core.trainer.update import Learner, update_actor, update_critic

__all__ = ["Trainer", "TrainingAborted", "fit", "seed_everything"]


def seed_everything(seed: int) -> None:
    """Python, torch (CPU and the active accelerator through torch's generic API)."""
    random.seed(seed)
    torch.manual_seed(seed)  # seeds every device's default generator too
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


class Trainer:
    """Everything a run needs, built once from the config (every user mistake surfaces here as
    ``BadInputError``, before a run directory exists), and ``step()``: one training step, top to bottom.

    Where things live is the backend's decision (``Backend.device`` / ``Backend.generator``): models and every
    tensor of the training batch on ``self.device``; the generators on the CPU."""

    def __init__(self, cfg: RunConfig, backend: Any, device: torch.device | None = None) -> None:
        check_config(cfg)
        self.cfg = cfg
        self.backend = backend
        self.device = device if device is not None else backend.device(D.get_local_rank())
        if cfg.trainer.num_threads > 0:
            torch.set_num_threads(cfg.trainer.num_threads)
        seed_everything(cfg.trainer.seed)
        self.task = build_task(cfg)
        self.tokenizer = build_tokenizer(cfg, self.task)
        tiny_vocab = len(self.tokenizer) if self.task.vocab() else None
        self.models = build_models(cfg, tiny_vocab, backend, self.device)
        self.state = TrainerState(cfg.trainer.seed, self.task, build_kl_controller(cfg), backend.generator)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # Packing needs an attention that splits documents by position_ids; others get padded rows.
        packed = cfg.model.attn_implementation == "polyrl"
        max_len = cfg.data.max_prompt_length + cfg.rollout.max_response_length
        sampling = sampling_params(cfg, self.tokenizer.eos_token_id)
        self.engine = build_engine(resolve_engine(cfg.rollout.engine, backend), self.models.actor, pad_token_id=pad_id,
                                   backend=backend, max_model_len=max_len, sampling=sampling)
        self.rollout = Rollout(
            task=self.task, tokenizer=self.tokenizer, engine=self.engine,
            sampling=sampling, sample_gen=self.state.sample_gen,
            task_rng=self.state.task_rng, device=self.device,
        )
        m, c = self.models, self.state.counters
        # model.fused_logprobs: the backend's fused lm_head + log-prob kernel (no [T, V] logits), or None
        self.fused = fused_kernel_for(cfg.model.fused_logprobs, m.actor, backend)
        self.actor = Learner(m.actor, m.optimizer, self.state.shuffle_gen, c, packed, pad_id, backend.logprobs,
                             self.fused)
        self.critic = Learner(m.critic, m.critic_optimizer, self.state.shuffle_gen, c, packed, pad_id) if m.critic else None
        # every sync into an engine with its own weights is checked on this probe (polyrl.core.trainer.sync)
        actor_cfg = getattr(m.actor, "config", None)
        self.probe = sync.probe_sequences(actor_cfg, int(getattr(actor_cfg, "vocab_size", 2)), max_len=max_len)
        # the bar of the lower precision among the model's dtype and the backend's FSDP compute dtype
        dtypes = {cfg.model.dtype, backend.sharding_policy().param_dtype}
        self.probe_dtype = "float32" if dtypes == {"float32"} else sorted(dtypes - {"float32"})[0]
        self.sync_metrics = sync.verify(self.engine, m.actor, self.probe, self.probe_dtype, **self._probe_kwargs())

    # --- the step ----------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        # 1-2. rollout and reward (with overlong shaping and DAPO dynamic sampling)
        exp = collect_experience(self.cfg, self.rollout)
        sync.sleep(self.engine)  # the engine's memory is the trainer's until the sync
        metrics = dict(exp.metrics)
        if exp.batch is not None:
            metrics.update(self._learn(exp.batch, exp.scores))
        # LR schedule: once per training step
        metrics["actor/lr"] = self.models.optimizer.param_groups[0]["lr"]
        with warnings.catch_warnings():  # a step whose updates were all skipped never called optimizer.step()
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.models.scheduler.step()
            if self.models.critic_scheduler is not None:
                self.models.critic_scheduler.step()
        # 6. the engine generates with the new weights from the next step on (verified: polyrl.core.trainer.sync)
        metrics.update(self.sync_engine())
        c = self.state.counters
        c.gen_batches += exp.gen_batches
        c.groups_filtered += exp.groups_filtered
        c.overlong_penalized += exp.overlong_penalized
        c.reward_errors += exp.reward_errors
        c.reward_timeouts += exp.reward_timeouts
        metrics["train/nonfinite_skipped"] = c.nonfinite_skipped
        metrics["train/skipped_no_data"] = int(exp.batch is None)
        self.state.step += 1
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics.update(self.backend.memory_metrics())
        metrics = D.all_reduce_metrics(metrics, ops={"time/step_s": "max", "time/rollout_s": "max",
                                                     "memory/peak_gib": "max", "batch/tokens": "sum"})
        return {"step": self.state.step, **metrics}

    def sync_engine(self) -> dict[str, float]:
        """The actor's weights into the rollout engine, verified (after every update, and after a resume loaded a
        checkpoint into the actor: an engine with its own weights still holds the initial ones)."""
        return sync.sync_and_verify(self.engine, self.models.actor, self.probe, self.probe_dtype, **self._probe_kwargs())

    def _forward_kwargs(self) -> dict[str, Any]:
        return dict(packed=self.actor.packed, pad_id=self.actor.pad_id)

    def _probe_kwargs(self) -> dict[str, Any]:
        return dict(packed=self.actor.packed, pad_id=self.actor.pad_id, chunk_size=self.cfg.trainer.logprob_chunk_size,
                    logprobs=self.backend.logprobs, linear_logprobs=self.fused)

    def _learn(self, batch: SequenceBatch, scores: torch.Tensor) -> dict[str, float]:
        cfg, alg = self.cfg, self.cfg.algorithm
        m = self.models
        t0 = time.perf_counter()
        budget = cfg.algorithm.micro_batch_tokens
        mask = batch.mask
        fw = self._forward_kwargs()
        lp = dict(temperature=cfg.rollout.temperature, chunk_size=cfg.trainer.logprob_chunk_size,
                  logprobs=self.backend.logprobs,  # the backend's log-prob kernel (reference by default)
                  linear_logprobs=self.fused)
        # 3. old log-probs (the trainer's view of the behaviour policy), reference, critic values
        ent = torch.zeros_like(mask)

        def actor_fn(rows: list[int]) -> torch.Tensor:
            logp, e = policy_forward(m.actor, batch, rows, **fw, **lp, compute_entropy=True)
            ent[rows] = e.detach()
            return logp

        old_logp = forward_all(actor_fn, batch, budget)
        metrics = {
            "batch/tokens": sum(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)),  # this rank's
            "rollout/logprob_diff": _global_mean((old_logp - batch.rollout_logp).abs(), mask),
            "actor/entropy": _global_mean(ent, mask),
        }
        ref_logp = None
        if m.ref is not None:
            ref_logp = forward_all(
                lambda rows: policy_forward(m.ref, batch, rows, **fw, **lp, compute_entropy=False)[0], batch, budget)
            metrics["kl/actor_ref"] = _global_mean(A.kl_penalty(old_logp, ref_logp, "k1"), mask)
        values = None
        if m.critic is not None:
            values = forward_all(lambda rows: value_forward(m.critic, batch, rows, **fw), batch, budget)
        metrics["time/old_logprob_s"] = time.perf_counter() - t0
        # 4. token rewards (score on the last token, minus β·KL) and advantages
        token_rewards = A.last_token_rewards(scores, mask)
        if alg.use_kl_in_reward and ref_logp is not None:
            token_rewards, kl_m = A.compute_kl_in_reward(token_rewards, old_logp, ref_logp, mask, self.state.kl_ctrl,
                                                         alg.kl_kind)
            metrics["kl/reward_kl"], metrics["kl/coef"] = kl_m["kl"], kl_m["kl_coef"]
        returns = None
        if alg.adv_estimator == "gae":
            # whitening statistics are those of the global batch, not of this rank's share
            advantages, returns = A.gae_advantages(token_rewards, values, mask, alg.gamma, alg.lam, whiten=False)
            advantages = A.masked_whiten(advantages, mask, reduce_sum=D.all_reduce_ if D.is_distributed() else None)
        else:
            seq = A.sequence_scores(token_rewards, mask)
            advantages = A.broadcast_to_tokens(A.group_advantages(seq, batch.group_ids, norm_by_std=alg.norm_adv_by_std),
                                               mask)
        metrics["advantages/mean"] = _global_mean(advantages, mask)
        metrics["advantages/abs_mean"] = _global_mean(advantages.abs(), mask)
        metrics["time/prepare_s"] = time.perf_counter() - t0
        # 5. updates: critic first (its targets are fixed), then the actor after the critic warmup
        t1 = time.perf_counter()
        if self.critic is not None:
            metrics.update(update_critic(cfg, self.critic, batch, values, returns))
            metrics["critic/explained_var"] = _explained_variance(values, returns, mask)
        if self.state.step >= alg.critic_warmup_steps:
            metrics.update(update_actor(cfg, self.actor, batch, old_logp, ref_logp, advantages))
        metrics["time/update_s"] = time.perf_counter() - t1
        return metrics

    # --- checkpoints -------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        m = self.models
        return {"model": m.actor, "optimizer": m.optimizer, "critic": m.critic, "critic_optimizer": m.critic_optimizer,
                "scheduler": m.scheduler, "critic_scheduler": m.critic_scheduler, "trainer": self.state}

    def weights_finite(self) -> bool:
        mods = [self.models.actor] + ([self.models.critic] if self.models.critic is not None else [])
        # FSDP params are DTensors: check this rank's shard, then agree across ranks
        local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for mod in mods for p in mod.parameters()]
        ok = all(bool(torch.isfinite(t).all()) for t in local)
        return bool(D.all_reduce_(torch.tensor(float(not ok)), "max").item() == 0.0)


def _global_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Masked mean over the tokens of every rank (sum and count all-reduced in fp64): under ``--nproc`` the
    ranks hold different token counts, so an average of per-rank means would not be the batch's mean."""
    m = mask.to(torch.float64)
    stats = D.all_reduce_(torch.stack([(values.detach().to(torch.float64) * m).sum(), m.sum()]))
    total, count = stats.tolist()
    return total / max(count, 1.0)


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    var_r = float(A.masked_mean((returns - A.masked_mean(returns, mask)) ** 2, mask))
    resid = returns - values
    var_e = float(A.masked_mean((resid - A.masked_mean(resid, mask)) ** 2, mask))
    return 1.0 - var_e / var_r if var_r > 0 and math.isfinite(var_r) else 0.0


def fit(trainer: Trainer, run_dir: Any, *, progress: bool = True, log: Any = None) -> dict[str, float]:
    """Train until ``trainer.total_steps``: step, log, checkpoint every ``save_every`` steps and at the end.

    Resumes from the newest complete checkpoint in ``run_dir.checkpoints`` when there is one (the caller
    has already done so and set ``trainer.state.step``). A checkpoint is written only when every weight is
    finite. Returns the last step's metrics.

    A torchrun worker whose launcher or agent is gone writes nothing more (``check_lifeline`` before each
    metrics line; ``save_checkpoint`` checks before it publishes).
    """
    from polyrl.core.distributed.launch import check_lifeline
    from polyrl.core.run.checkpoint import save_checkpoint

    cfg = trainer.cfg.trainer
    bar = None
    if progress and D.is_main_process():
        from tqdm import tqdm

        bar = tqdm(total=cfg.total_steps, initial=trainer.state.step, desc="polyrl", unit="step", dynamic_ncols=True)
    last: dict[str, float] = {}
    try:
        if trainer.state.step > 0:  # resumed: the checkpoint's weights are not in the engine yet
            trainer.sync_engine()
        while trainer.state.step < cfg.total_steps:
            last = trainer.step()
            check_lifeline()
            run_dir.log(last)
            if bar is not None:
                bar.set_postfix(reward=f"{last['reward/mean']:.3f}", loss=f"{last.get('loss/policy', 0.0):.4f}",
                                s_step=f"{last['time/step_s']:.2f}", refresh=False)
                bar.update(1)
            step = trainer.state.step
            if (cfg.save_every > 0 and step % cfg.save_every == 0) or step == cfg.total_steps:
                if trainer.weights_finite():
                    save_checkpoint(run_dir.checkpoints, step, trainer.checkpoint_state(),
                                    keep=cfg.keep_checkpoints or None, backend=trainer.backend)
                elif log is not None:
                    log(f"step {step}: weights are not finite; checkpoint not written")
    finally:
        if bar is not None:
            bar.close()
        if callable(getattr(trainer.engine, "close", None)):
            trainer.engine.close()  # an engine with its own process state (vLLM) ends before the process group
    return last
