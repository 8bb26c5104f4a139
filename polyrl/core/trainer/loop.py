"""The trainer: ``Trainer.train()`` is the life of a run, ``Trainer.step()`` one step of typed stages.

A run, in :meth:`Trainer.train`, top to bottom: resume from the newest verified checkpoint (or start fresh),
open the run directory, then step → log → checkpoint every ``save_every`` steps and at the last one. Each part
runs as a stage of the run's guard (:mod:`polyrl.core.run.guard`), which alone decides what an exception that
leaves the run means: a stop signal ends it between or inside steps (``RunStopped``, the checkpoint in progress
abandoned), non-finite updates in a row and exhausted dynamic sampling end it with ``TrainingAborted``, and so
does a fault of the machine (a full or unwritable disk, device memory, a failing rollout engine or reward
workers: :mod:`polyrl.core.run.faults`), its message the one line that names it, what to do and where the same
command resumes.

A step, in :meth:`Trainer.step`, is three stages with explicit data, each usable alone (step parity, a new
engine or algorithm plug in here)::

    collect()                -> Experience     rollout → reward → shaping → dynamic sampling, then the
                                                 trainer's old / reference log-probs and the critic's values
    prepare_update(exp)      -> UpdateInputs   pure: token rewards, KL in the reward, advantages, returns
    update(inputs)           -> UpdateMetrics  critic then actor PPO epochs

then the LR schedule and the verified weight sync into the rollout engine; the stages' typed metrics
(:mod:`polyrl.core.trainer.metrics`) are flattened into the step's one line. Everything a run needs is built once
in ``Trainer.__init__`` (:mod:`polyrl.core.trainer.setup`), where every user mistake surfaces as
``BadInputError`` before a run directory exists. SPMD: each rank takes its slice of the prompts, token counts
are all-reduced, metrics are averaged over ranks and written by rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from polyrl.core import algorithms as A
from polyrl.core import distributed as D
from polyrl.core.config import RunConfig, dump_config
from polyrl.core.distributed import launch as L
from polyrl.core.rollout import is_verified
from polyrl.core.run.guard import RunGuard
from polyrl.core.run.outcome import RunFault, RunStopped, TrainingAborted
from polyrl.core.trainer import sync
from polyrl.core.trainer.batch import forward_all, policy_forward, split_routes, value_forward
from polyrl.core.trainer.experience import Experience, sample_experience
from polyrl.core.trainer.metrics import StepMetrics, UpdateMetrics, ViewMetrics, flatten
from polyrl.core.trainer.mismatch import resolve_enable, resolve_old_logprobs
from polyrl.core.trainer.prepare import UpdateInputs, global_mean, prepare_update
from polyrl.core.trainer.setup import Components, build_components
from polyrl.core.trainer.update import update_actor, update_critic

if TYPE_CHECKING:
    from pathlib import Path

    from polyrl.core.plugins.backend import Backend
    from polyrl.core.run.directory import RunDir

__all__ = ["RunFault", "RunStopped", "Trainer", "TrainingAborted", "seed_everything"]


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
    """Everything a run needs, built once from the config, and the stages of a step.

    Where things live is the backend's decision (``Backend.device`` / ``Backend.generator``): models and every
    tensor of the training batch on ``self.device``; the generators on the CPU. The backend is bound to the
    models when they are built (their attention dispatches to it)."""

    def __init__(self, cfg: RunConfig, backend: Backend) -> None:
        self.cfg, self.backend = cfg, backend
        self.device: torch.device = backend.device(D.get_local_rank())
        if cfg.trainer.num_threads > 0:
            torch.set_num_threads(cfg.trainer.num_threads)
        seed_everything(cfg.trainer.seed)
        parts: Components = build_components(cfg, backend, self.device)
        self.task, self.tokenizer, self.models, self.state = parts.task, parts.tokenizer, parts.models, parts.state
        self.engine, self.rollout, self.actor, self.critic = parts.engine, parts.rollout, parts.actor, parts.critic
        # the stage being run, and the one line a fault becomes (polyrl.core.run.guard)
        self.guard = RunGuard(cfg, step=lambda: self.state.step, plan=self._memory_plan)
        # every sync into an engine with its own weights is checked on this probe (polyrl.core.trainer.sync)
        self.probe, self.probe_dtype = parts.probe, parts.probe_dtype
        self.engine_choice = parts.engine_choice  # which rollout engine and why (the run log's second line)
        self.precompiled = parts.precompiled  # kernels compiled ahead of the first step, if any (logged after it)
        # algorithm.rollout_correction.enable resolved for this engine (auto: on when it has its own weights);
        # prepare_update reads the resolved settings, the run log says what was chosen
        rc = cfg.algorithm.rollout_correction
        rc_on, self.correction_choice = resolve_enable(rc, str(getattr(self.engine, "name", type(self.engine).__name__)),
                                                       is_verified(self.engine))
        self.algorithm = dataclasses.replace(cfg.algorithm, rollout_correction=dataclasses.replace(rc, enable=rc_on))
        # algorithm.old_logprobs resolved likewise: True when π_old is the engine's sampling log-probs
        self.old_logp_from_engine, self.old_logprobs_choice = resolve_old_logprobs(
            cfg.algorithm, str(getattr(self.engine, "name", type(self.engine).__name__)), is_verified(self.engine),
            rc_on, str(cfg.rollout.routing_replay))
        self.algorithm = dataclasses.replace(
            self.algorithm, old_logprobs="engine" if self.old_logp_from_engine else "recompute")
        self.sync_metrics = sync.verify(self.engine, self.models.actor, self.probe, self.probe_dtype,
                                        **self._probe_kwargs())

    # --- the run -------------------------------------------------------------------------------------
    def train(self, run_dir: RunDir, *, resume_from: str | None = None, progress: bool = False,
              log: Callable[[str], None] = lambda msg: None) -> dict[str, float]:
        """Resume (verified), then train until ``trainer.total_steps``: step, log, checkpoint every
        ``save_every`` steps and at the end (only when every weight is finite). Returns the last step's metrics
        ({} when the run was already complete). ``log``: one-line messages for the user (rank 0's).

        Raises ``BadInputError`` (a checkpoint that fails verification: nothing was written), ``TrainingAborted``,
        ``RunStopped``. A torchrun worker whose launcher or agent is gone writes nothing more
        (``check_lifeline`` before each metrics line; ``save_checkpoint`` checks before it publishes)."""
        from polyrl.core.run.checkpoint import load_latest_checkpoint

        # resume: collective on every rank, unconditionally (rank 0 decides and broadcasts: a per-rank look at the
        # directory races with rank 0 creating it). Verified before anything is loaded; a refusal is bad input.
        resumed = load_latest_checkpoint(run_dir.checkpoints, self.checkpoint_state(), backend=self.backend,
                                         resume_from=resume_from)
        log(f"backend {self.backend.origin()}")  # the run log's first line, past the last bad input
        if self.engine_choice:
            log(self.engine_choice)
        if self.precompiled:
            log(self.precompiled)
        log(self.correction_choice)
        log(self.old_logprobs_choice)
        total, every, guard = self.cfg.trainer.total_steps, self.cfg.trainer.save_every, self.guard
        last: dict[str, float] = {}
        with guard.run(run_dir.checkpoints), self._opened(run_dir, resumed, log), \
                _progress_bar(progress, total, self.state.step) as tick:
            while self.state.step < total:
                with guard.stage("step"):
                    last = self.step()
                L.check_lifeline()  # a worker whose launcher is gone writes nothing more
                with guard.stage("logging", where=run_dir.path):
                    run_dir.log(last)
                    tick(last)
                if self.state.step == total or (every > 0 and self.state.step % every == 0):  # periodic and final
                    with guard.stage("saving", where=run_dir.checkpoints):
                        self.save(run_dir.checkpoints, log)
        return last

    @contextlib.contextmanager
    def _opened(self, run_dir: RunDir, resumed: int | None, log: Callable[[str], None]) -> Iterator[None]:
        """The run directory open (resolved config, metrics cut back to the resumed step, the export's metadata)
        and the engine holding the resumed weights; on every way out the engine, then the directory, close."""
        from polyrl.core.run.export import save_model_metadata

        try:
            with self.guard.stage("opening", where=run_dir.path):
                run_dir.open(dump_config(self.cfg), resume_step=resumed)
                save_model_metadata(run_dir.checkpoints, self.models.actor, self.tokenizer)  # for `polyrl export`
            if resumed is not None:
                log(f"resuming {run_dir.path} from step {resumed}")
                with self.guard.stage("resuming", where=run_dir.path):
                    self.sync_engine()  # the checkpoint's weights are not in the engine yet
            yield
        finally:
            if callable(getattr(self.engine, "close", None)):  # optional: not every engine has a process of its own
                self.engine.close()  # an engine with its own process state (vLLM) ends before the process group
            run_dir.close()

    def save(self, checkpoints: Path, log: Callable[[str], None] = lambda msg: None) -> bool:
        """Checkpoint the current step when every weight is finite (else say so); collective."""
        from polyrl.core.run.checkpoint import save_checkpoint

        if not self.weights_finite():
            log(f"step {self.state.step}: weights are not finite; checkpoint not written")
            return False
        save_checkpoint(checkpoints, self.state.step, self.checkpoint_state(),
                        keep=self.cfg.trainer.keep_checkpoints or None, backend=self.backend)
        return True

    # --- the step --------------------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """collect → prepare_update → update, the LR schedule, the verified sync; the step's metrics, flattened
        (:mod:`polyrl.core.trainer.metrics`) and reduced over ranks: one line of ``metrics.jsonl``."""
        t0 = time.perf_counter()
        exp = self.collect()
        inputs, update, prepare_s = None, None, None
        if exp.batch is not None:
            t1 = time.perf_counter()
            inputs = self.prepare_update(exp)
            if inputs.reward_kl is not None:  # the adaptive KL controller learns from this batch's KL
                self.state.kl_ctrl.update(inputs.reward_kl, n_steps=exp.batch.size)
            # from the old log-probs to the advantages, as in polyrl 0.1
            prepare_s = exp.view_metrics.time_old_logprob_s + time.perf_counter() - t1
            update = self.update(inputs)
        lr = self.models.optimizer.param_groups[0]["lr"]  # the LR this step's updates used
        self._schedule_lr()
        synced = self.sync_engine()  # the engine generates with the new weights from the next step on
        self.state.step += 1
        record = StepMetrics(
            rollout=exp.metrics, views=exp.view_metrics, prepare=inputs.metrics if inputs else None,
            time_prepare_s=prepare_s, update=update, actor_lr=lr, sync=synced,
            train_nonfinite_skipped=self.state.counters.nonfinite_skipped,
            train_skipped_no_data=int(exp.batch is None), time_step_s=time.perf_counter() - t0,
            memory=self.backend.memory_metrics(),
        )
        metrics = D.all_reduce_metrics(flatten(record), ops={"time/step_s": "max", "time/rollout_s": "max",
                                                             "memory/peak_gib": "max", "batch/tokens": "sum"})
        return {"step": self.state.step, **metrics}

    def collect(self) -> Experience:
        """Stage 1: sample and score this step's experience, put the engine to sleep (its memory is the trainer's
        until the sync), then the trainer's views of the sampled tokens: the actor's log-probs (the PPO ratio's
        denominator), the reference's (KL), the critic's values (GAE)."""
        with self.guard.stage("rollout"):
            exp = sample_experience(self.cfg, self.rollout)
        with self.guard.stage("log-probs"):
            self.engine.sleep()
            return exp if exp.batch is None else self._views(exp)

    def _views(self, exp: Experience) -> Experience:
        """``exp`` with the trainer's views of its tokens ([B, R] each) and their metrics."""
        t0 = time.perf_counter()
        batch, m = exp.batch, self.models
        budget = self.cfg.algorithm.micro_batch_tokens
        fw = self.actor.policy_kwargs(self.cfg)
        ent = torch.zeros_like(batch.mask)  # [B, R]
        replay = self.actor.replay  # routing replay (rollout.routing_replay), None when off
        record = replay is not None and batch.routes is None  # r2: the update replays this pass's routing
        recorded: list = [None] * batch.size
        if replay is not None:
            replay.reset_counts()

        def actor_fn(rows: list[int]) -> torch.Tensor:
            logp, e = policy_forward(m.actor, batch, rows, **fw, compute_entropy=True, **routing_kw)
            ent[rows] = e.detach()
            if record:
                for r, route in zip(rows, split_routes(replay.take_recorded(), batch, rows, self.actor.packed)):
                    recorded[r] = route
            return logp

        routing_kw = {"record_routes": True} if record else {}
        # algorithm.old_logprobs: with the engine's log-probs as π_old the actor's forward runs only on the drift
        # check's steps (and then measures, it does not replace: π_old stays the engine's)
        every = self.cfg.algorithm.old_logprobs_check_every
        recompute = not self.old_logp_from_engine or (every > 0 and self.state.step % every == 0)
        trainer_logp = forward_all(actor_fn, batch, budget) if recompute else None
        old_logp = batch.rollout_logp.clone() if self.old_logp_from_engine else trainer_logp
        routing_mismatch = replay.changed / replay.forced if replay is not None and replay.forced else None
        if recompute and replay is not None and batch.routes is not None and not replay.forced:
            # e.g. a hub kernel that replaces the whole MoE block and never calls its router module
            raise RuntimeError("routing replay: routes were given but no router hook ran them (the model's MoE "
                               "forward bypasses its router modules)")
        if record:
            batch.routes = recorded
        if replay is not None:
            # The reference's forward declares no routing, and under LoRA it *is* the actor (adapters off: the same
            # routers, the same hooks): left as the last micro-batch above set them, the hooks would force its routes
            # on the reference's micro-batches (r3) or record them (r2).
            replay.idle()
        ref_logp = kl_ref = None
        ref_fw = {k: v for k, v in fw.items() if k != "replay"}  # the reference routes by its own router
        with m.reference() as ref:  # the frozen copy, or the actor with its LoRA adapters off
            if ref is not None:
                ref_logp = forward_all(lambda rows: policy_forward(ref, batch, rows, **ref_fw, compute_entropy=False)[0],
                                       batch, budget)
                kl_ref = global_mean(A.kl_penalty(old_logp, ref_logp, "k1"), batch.mask)
        values = None
        if self.critic is not None:
            c = self.critic
            values = forward_all(lambda rows: value_forward(c.model, batch, rows, packed=c.packed, pad_id=c.pad_id),
                                 batch, budget)
        metrics = ViewMetrics(
            batch_tokens=sum(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)),  # this rank's
            rollout_logprob_diff=(None if trainer_logp is None
                                  else global_mean((trainer_logp - batch.rollout_logp).abs(), batch.mask)),
            actor_entropy=None if trainer_logp is None else global_mean(ent, batch.mask), kl_actor_ref=kl_ref,
            time_old_logprob_s=time.perf_counter() - t0, rollout_routing_mismatch=routing_mismatch,
        )
        return dataclasses.replace(exp, old_logp=old_logp, ref_logp=ref_logp, values=values, view_metrics=metrics,
                                   check_logp=trainer_logp if self.old_logp_from_engine else None)

    def prepare_update(self, exp: Experience) -> UpdateInputs:
        """Stage 2 (pure): advantages, returns, token rewards for ``exp`` (:func:`prepare.prepare_update`)."""
        return prepare_update(self.algorithm, exp, kl_ctrl=self.state.kl_ctrl)

    def update(self, inputs: UpdateInputs) -> UpdateMetrics:
        """Stage 3: the critic first (its targets are fixed), then the actor once the critic warmup is over. Skipped
        (non-finite) updates are counted on ``self.state.counters``, the run's one set of counters."""
        t0 = time.perf_counter()
        critic = actor = None
        if self.critic is not None:
            with self.guard.stage("critic update"):
                critic = update_critic(self.cfg, self.critic, inputs, self.state.counters)
        if self.state.step >= self.cfg.algorithm.critic_warmup_steps:
            with self.guard.stage("update"):
                actor = update_actor(self.cfg, self.actor, inputs, self.state.counters)
        return UpdateMetrics(critic=critic, actor=actor, time_update_s=time.perf_counter() - t0)

    def sync_engine(self) -> dict[str, float]:
        """The actor's weights into the rollout engine, verified (after every update, and after a resume loaded a
        checkpoint into the actor: an engine with its own weights still holds the initial ones)."""
        with self.guard.stage("weight sync"):
            return sync.sync_and_verify(self.engine, self.models.actor, self.probe, self.probe_dtype,
                                        **self._probe_kwargs())

    def _schedule_lr(self) -> None:
        """The LR schedules, once per training step."""
        with warnings.catch_warnings():  # a step whose updates were all skipped never called optimizer.step()
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.models.scheduler.step()
            if self.models.critic_scheduler is not None:
                self.models.critic_scheduler.step()

    def _probe_kwargs(self) -> dict[str, Any]:
        fw = self.actor.policy_kwargs(self.cfg)
        del fw["temperature"]  # the probe compares temperature-1 log-probs
        return fw

    def _memory_plan(self) -> Any:
        """The dry-run memory plan of this run on this world (``polyrl.core.plan``), for the out-of-memory line."""
        from polyrl.core.plan import plan_memory

        world = D.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return plan_memory(self.cfg, self.backend, nproc=local, nnodes=max(1, world // local),
                           vocab_size=getattr(getattr(self.models.actor, "config", None), "vocab_size", None))

    # --- checkpoints -------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        m = self.models
        return {"model": m.actor, "optimizer": m.optimizer, "critic": m.critic, "critic_optimizer": m.critic_optimizer,
                "scheduler": m.scheduler, "critic_scheduler": m.critic_scheduler, "trainer": self.state}

    def weights_finite(self) -> bool:
        """Every weight of the actor (and critic) finite, on every rank; one host sync. FSDP params are DTensors:
        each rank checks its shard. A fused max-abs per tensor (inf-norm: NaN and inf propagate, finite values
        never overflow) decides exactly as an elementwise ``isfinite``."""
        mods = [self.models.actor] + ([self.models.critic] if self.models.critic is not None else [])
        local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for mod in mods for p in mod.parameters()]
        local = [t for t in local if t.numel()]  # a rank's shard of a small parameter can be empty
        peaks = torch._foreach_norm(local, float("inf")) if local else []  # max |x|: one 0-d tensor per tensor
        finite = torch.stack([x.float() for x in peaks]).isfinite().all() if peaks else torch.tensor(True)
        return D.all_reduce_((~finite).float(), "max").item() == 0.0


@contextlib.contextmanager
def _progress_bar(enabled: bool, total: int, initial: int) -> Iterator[Callable[[dict[str, float]], None]]:
    """tqdm's bar on rank 0 when ``enabled``; ``tick(metrics)`` after each logged step."""
    if not (enabled and D.is_main_process()):
        yield lambda metrics: None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, initial=initial, desc="polyrl", unit="step", dynamic_ncols=True)

    def tick(m: dict[str, float]) -> None:
        bar.set_postfix(reward=f"{m['reward/mean']:.3f}", loss=f"{m.get('loss/policy', 0.0):.4f}",
                        s_step=f"{m['time/step_s']:.2f}", refresh=False)
        bar.update(1)

    try:
        yield tick
    finally:
        bar.close()
