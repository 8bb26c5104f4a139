"""The trainer: ``Trainer.train()`` is the life of a run, ``Trainer.step()`` one step of typed stages.

A run, in :meth:`Trainer.train`, top to bottom: resume from the newest verified checkpoint (or start fresh),
open the run directory, then step → log → checkpoint every ``save_every`` steps and at the last one; a stop
signal ends it between or inside steps (``RunStopped``, the checkpoint in progress abandoned), non-finite
updates in a row and exhausted dynamic sampling end it with ``TrainingAborted``, and so does a fault of the
machine (a full or unwritable disk, device memory, a failing rollout engine or reward workers:
:mod:`polyrl.core.run.faults`), its message the one line that names it, what to do and where the same command
resumes.

A step, in :meth:`Trainer.step`, is three stages with explicit data, each usable alone (step parity, a new
engine or algorithm plug in here)::

    collect()                -> Experience     rollout → reward → shaping → dynamic sampling, then the
                                                 trainer's old / reference log-probs and the critic's values
    prepare_update(exp)      -> UpdateInputs   pure: token rewards, KL in the reward, advantages, returns
    update(inputs)           -> UpdateMetrics  critic then actor PPO epochs

then the LR schedule and the verified weight sync into the rollout engine. Everything a run needs is built once
in ``Trainer.__init__`` (:mod:`polyrl.core.trainer.setup`), where every user mistake surfaces as
``BadInputError`` before a run directory exists. SPMD: each rank takes its slice of the prompts, token counts
are all-reduced, metrics are averaged over ranks and written by rank 0.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from polyrl.core import algorithms as A
from polyrl.core import distributed as D
from polyrl.core.config import RunConfig, dump_config
from polyrl.core.distributed import launch as L
from polyrl.core.distributed.process import exit_if_a_peer_is_gone
from polyrl.core.run.faults import fault_line
from polyrl.core.trainer import sync
from polyrl.core.trainer.batch import forward_all, policy_forward, value_forward
from polyrl.core.trainer.experience import Experience, TrainingAborted, sample_experience
from polyrl.core.trainer.prepare import UpdateInputs, global_mean, prepare_update
from polyrl.core.trainer.setup import Components, build_components
from polyrl.core.trainer.update import UpdateMetrics, update_actor, update_critic

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


class RunFault(TrainingAborted):
    """A fault of the machine met by this process (a full disk, device memory, a failing engine); other ranks
    may not have met it, so the process ends without waiting for them (their peer watch stops them)."""


class RunStopped(Exception):
    """A stop signal (SIGINT/SIGTERM/SIGHUP) ended the run; ``message`` is the one line for the user."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum, self.message = signum, message


class Trainer:
    """Everything a run needs, built once from the config, and the stages of a step.

    Where things live is the backend's decision (``Backend.device`` / ``Backend.generator``): models and every
    tensor of the training batch on ``self.device``; the generators on the CPU. The backend is bound to the
    models when they are built (their attention dispatches to it)."""

    def __init__(self, cfg: RunConfig, backend: Any, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.phase: str | None = None  # the stage of the step being run (named when device memory runs out)
        self.backend = backend
        self.device = device if device is not None else backend.device(D.get_local_rank())
        if cfg.trainer.num_threads > 0:
            torch.set_num_threads(cfg.trainer.num_threads)
        seed_everything(cfg.trainer.seed)
        parts: Components = build_components(cfg, backend, self.device)
        self.task, self.tokenizer, self.models, self.state = parts.task, parts.tokenizer, parts.models, parts.state
        self.engine, self.rollout, self.actor, self.critic = parts.engine, parts.rollout, parts.actor, parts.critic
        self.fused = parts.fused  # the backend's fused lm_head + log-prob kernel, or None (model.fused_logprobs)
        # every sync into an engine with its own weights is checked on this probe (polyrl.core.trainer.sync)
        self.probe, self.probe_dtype = parts.probe, parts.probe_dtype
        self.sync_metrics = sync.verify(self.engine, self.models.actor, self.probe, self.probe_dtype,
                                        **self._probe_kwargs())

    # --- the run -------------------------------------------------------------------------------------
    def train(self, run_dir: Any, *, resume_from: str | None = None, progress: bool = False,
              log: Callable[[str], None] = lambda msg: None) -> dict[str, float]:
        """Resume (verified), then train until ``trainer.total_steps``: step, log, checkpoint every
        ``save_every`` steps and at the end (only when every weight is finite). Returns the last step's metrics
        ({} when the run was already complete). ``log``: one-line messages for the user (rank 0's).

        Raises ``BadInputError`` (a checkpoint that fails verification: nothing was written), ``TrainingAborted``,
        ``RunStopped``. A torchrun worker whose launcher or agent is gone writes nothing more
        (``check_lifeline`` before each metrics line; ``save_checkpoint`` checks before it publishes)."""
        from polyrl.core.run.checkpoint import load_latest_checkpoint
        from polyrl.core.run.export import save_model_metadata
        from polyrl.core.run.outcome import resume_point, stopped_message

        # 1. resume: collective on every rank, unconditionally (rank 0 decides and broadcasts: a per-rank look at
        # the directory races with rank 0 creating it). Verified before anything is loaded; refusal = bad input.
        resumed = load_latest_checkpoint(run_dir.checkpoints, self.checkpoint_state(), backend=self.backend,
                                         resume_from=resume_from)
        log(f"backend {self.backend.origin()}")  # the run log's first line, past the last bad input
        total = self.cfg.trainer.total_steps
        bar = None
        last: dict[str, float] = {}
        doing, where = "while opening the run directory", run_dir.path  # for a fault's one line
        try:
            run_dir.open(dump_config(self.cfg), resume_step=resumed)
            save_model_metadata(run_dir.checkpoints, self.models.actor, self.tokenizer)  # for `polyrl export`
            if resumed is not None:
                log(f"resuming {run_dir.path} from step {resumed}")
                doing = "while resuming"
                self.sync_engine()  # the checkpoint's weights are not in the engine yet
            if progress and D.is_main_process():
                from tqdm import tqdm

                bar = tqdm(total=total, initial=self.state.step, desc="polyrl", unit="step", dynamic_ncols=True)
            # 2. the loop
            while self.state.step < total:
                doing, where = f"at step {self.state.step + 1}", None
                last = self.step()
                L.check_lifeline()
                doing, where = f"while logging step {self.state.step}", run_dir.path
                run_dir.log(last)
                if bar is not None:
                    bar.set_postfix(reward=f"{last['reward/mean']:.3f}", loss=f"{last.get('loss/policy', 0.0):.4f}",
                                    s_step=f"{last['time/step_s']:.2f}", refresh=False)
                    bar.update(1)
                # 3. periodic and final saves
                step = self.state.step
                if (self.cfg.trainer.save_every > 0 and step % self.cfg.trainer.save_every == 0) or step == total:
                    doing, where = f"while saving step {step}", run_dir.checkpoints
                    self.save(run_dir.checkpoints, log)
        except TrainingAborted:
            raise
        except BaseException as exc:
            # 4. the stop path: a signal — its KeyboardInterrupt, or whatever it became on the way out (DCP wraps
            # it in a CheckpointException; a stopping peer breaks a collective). A checkpoint being written was
            # abandoned: only complete ones are ever loaded.
            signum = L.stop_signal()
            if signum is None and not isinstance(exc, KeyboardInterrupt):
                # A collective broken by a dead peer is the peer's end, not a fault here: its line, then exit.
                exit_if_a_peer_is_gone()
                # a fault of the machine: one line, what to do, where the same command resumes; else a bug
                line = (_out_of_memory(self, doing) if isinstance(exc, torch.OutOfMemoryError)
                        else fault_line(exc, doing, where))
                if line is None:
                    raise
                raise RunFault(f"{line} and rerun: the same command {resume_point(run_dir.checkpoints)}") from exc
            signum = signum or 2  # None: a KeyboardInterrupt raised by Python's own handler
            raise RunStopped(signum, stopped_message(L.signal_name(signum), self.state.step,
                                                     run_dir.checkpoints)) from None
        finally:
            self.phase = None
            if bar is not None:
                bar.close()
            if callable(getattr(self.engine, "close", None)):
                self.engine.close()  # an engine with its own process state (vLLM) ends before the process group
            run_dir.close()
        return last

    def save(self, checkpoints: Any, log: Callable[[str], None] = lambda msg: None) -> bool:
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
        """collect → prepare_update → update, the LR schedule, the verified sync; the step's metrics."""
        t0 = time.perf_counter()
        exp = self.collect()
        self.phase = None
        metrics = dict(exp.metrics)
        if exp.batch is not None:
            t1 = time.perf_counter()
            inputs = self.prepare_update(exp)
            if inputs.reward_kl is not None:  # the adaptive KL controller learns from this batch's KL
                self.state.kl_ctrl.update(inputs.reward_kl, n_steps=exp.batch.size)
            metrics.update(inputs.metrics)
            # from the old log-probs to the advantages, as in polyrl 0.1
            metrics["time/prepare_s"] = exp.metrics["time/old_logprob_s"] + time.perf_counter() - t1
            metrics.update(self.update(inputs).values)
        # LR schedule: once per training step
        metrics["actor/lr"] = self.models.optimizer.param_groups[0]["lr"]
        with warnings.catch_warnings():  # a step whose updates were all skipped never called optimizer.step()
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.models.scheduler.step()
            if self.models.critic_scheduler is not None:
                self.models.critic_scheduler.step()
        # the engine generates with the new weights from the next step on (verified: polyrl.core.trainer.sync)
        self.phase = "weight sync"
        metrics.update(self.sync_engine())
        self.phase = None
        metrics["train/nonfinite_skipped"] = self.state.counters.nonfinite_skipped
        metrics["train/skipped_no_data"] = int(exp.batch is None)
        self.state.step += 1
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics.update(self.backend.memory_metrics())
        metrics = D.all_reduce_metrics(metrics, ops={"time/step_s": "max", "time/rollout_s": "max",
                                                     "memory/peak_gib": "max", "batch/tokens": "sum"})
        return {"step": self.state.step, **metrics}

    def collect(self) -> Experience:
        """Stage 1: sample and score this step's experience, put the engine to sleep (its memory is the trainer's
        until the sync), then the trainer's views of the sampled tokens: the actor's log-probs (the PPO ratio's
        denominator), the reference's (KL), the critic's values (GAE)."""
        self.phase = "rollout"
        exp = sample_experience(self.cfg, self.rollout)
        self.phase = "log-probs"
        sync.sleep(self.engine)
        if exp.batch is None:
            return exp
        t0 = time.perf_counter()
        batch, m = exp.batch, self.models
        budget = self.cfg.algorithm.micro_batch_tokens
        fw = self._forward_kwargs()
        ent = torch.zeros_like(batch.mask)

        def actor_fn(rows: list[int]) -> torch.Tensor:
            logp, e = policy_forward(m.actor, batch, rows, **fw, compute_entropy=True)
            ent[rows] = e.detach()
            return logp

        old_logp = forward_all(actor_fn, batch, budget)
        metrics = {
            "batch/tokens": sum(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)),  # this rank's
            "rollout/logprob_diff": global_mean((old_logp - batch.rollout_logp).abs(), batch.mask),
            "actor/entropy": global_mean(ent, batch.mask),
        }
        ref_logp = None
        if m.ref is not None:
            ref_logp = forward_all(lambda rows: policy_forward(m.ref, batch, rows, **fw, compute_entropy=False)[0],
                                   batch, budget)
            metrics["kl/actor_ref"] = global_mean(A.kl_penalty(old_logp, ref_logp, "k1"), batch.mask)
        values = None
        if m.critic is not None:
            values = forward_all(lambda rows: value_forward(m.critic, batch, rows, packed=self.actor.packed,
                                                            pad_id=self.actor.pad_id), batch, budget)
        metrics["time/old_logprob_s"] = time.perf_counter() - t0
        return dataclasses.replace(exp, old_logp=old_logp, ref_logp=ref_logp, values=values,
                                   metrics={**exp.metrics, **metrics})

    def prepare_update(self, exp: Experience) -> UpdateInputs:
        """Stage 2 (pure): advantages, returns, token rewards for ``exp`` (:func:`prepare.prepare_update`)."""
        return prepare_update(self.cfg.algorithm, exp, kl_ctrl=self.state.kl_ctrl)

    def update(self, inputs: UpdateInputs) -> UpdateMetrics:
        """Stage 3: the critic first (its targets are fixed), then the actor once the critic warmup is over."""
        t0 = time.perf_counter()
        skipped = self.state.counters.nonfinite_skipped
        metrics: dict[str, float] = {}
        if self.critic is not None:
            self.phase = "critic update"
            metrics.update(update_critic(self.cfg, self.critic, inputs))
            metrics["critic/explained_var"] = _explained_variance(inputs.values, inputs.returns, inputs.batch.mask)
        actor_updated = self.state.step >= self.cfg.algorithm.critic_warmup_steps
        if actor_updated:
            self.phase = "update"
            metrics.update(update_actor(self.cfg, self.actor, inputs))
        metrics["time/update_s"] = time.perf_counter() - t0
        return UpdateMetrics(metrics, actor_updated, self.state.counters.nonfinite_skipped - skipped)

    def sync_engine(self) -> dict[str, float]:
        """The actor's weights into the rollout engine, verified (after every update, and after a resume loaded a
        checkpoint into the actor: an engine with its own weights still holds the initial ones)."""
        return sync.sync_and_verify(self.engine, self.models.actor, self.probe, self.probe_dtype, **self._probe_kwargs())

    def _forward_kwargs(self) -> dict[str, Any]:
        """How the actor's forward is run everywhere (old log-probs, update, probe): packing, log-prob kernels."""
        return dict(packed=self.actor.packed, pad_id=self.actor.pad_id, temperature=self.cfg.rollout.temperature,
                    chunk_size=self.cfg.trainer.logprob_chunk_size, logprobs=self.backend.logprobs,
                    linear_logprobs=self.fused)

    def _probe_kwargs(self) -> dict[str, Any]:
        fw = self._forward_kwargs()
        del fw["temperature"]  # the probe compares temperature-1 log-probs
        return fw

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


def _out_of_memory(trainer: Trainer, doing: str) -> str:
    """Device memory ran out in ``trainer.phase``: the micro-batch size in use, the recipe key to lower, and what
    the dry-run plan predicted for that phase (``polyrl.core.plan``; omitted when it cannot be made)."""
    cfg, phase = trainer.cfg, trainer.phase or "step"
    said: list[str] = []  # in parentheses after the cause
    if phase == "rollout":
        seqs = cfg.data.batch_size // D.get_world_size() * cfg.rollout.n  # this rank's sequences of a batch
        size = cfg.rollout.micro_batch_size if 0 < cfg.rollout.micro_batch_size < seqs else seqs
        said.append(f"rollout.micro_batch_size={cfg.rollout.micro_batch_size}: {size} sequences generated together")
        todo, peak = f"set rollout.micro_batch_size lower (e.g. {max(1, size // 2)})", "rollout"
    elif phase in ("log-probs", "update", "critic update"):
        tokens = cfg.algorithm.micro_batch_tokens
        said.append(f"algorithm.micro_batch_tokens={tokens}")
        todo = f"lower algorithm.micro_batch_tokens (e.g. {max(1, tokens // 2)})" + (
            "" if cfg.trainer.activation_checkpointing else " or set trainer.activation_checkpointing=true")
        peak = "critic update" if phase == "critic update" else "update"
    else:
        todo, peak = "see the memory plan: polyrl run RECIPE --dry-run", ""
    try:
        from polyrl.core.plan import plan_memory

        world = D.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        plan = plan_memory(cfg, trainer.backend, nproc=local, nnodes=max(1, world // local),
                           vocab_size=getattr(getattr(trainer.models.actor, "config", None), "vocab_size", None))
        if peak in plan.phases:
            said.append(f"the dry-run plan predicted a peak of {plan.phases[peak]:.2f} GiB in the {peak}, "
                        f"{plan.usable_gib:.1f} GiB usable")
    except Exception:  # the plan is a hint: the line stands without it
        pass
    return f"device out of memory in the {phase} {doing}{' (' + '; '.join(said) + ')' if said else ''}; {todo}"


def _explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    var_r = float(A.masked_mean((returns - A.masked_mean(returns, mask)) ** 2, mask))
    resid = returns - values
    var_e = float(A.masked_mean((resid - A.masked_mean(resid, mask)) ** 2, mask))
    return 1.0 - var_e / var_r if var_r > 0 and math.isfinite(var_r) else 0.0
