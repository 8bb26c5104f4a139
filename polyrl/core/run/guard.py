"""The run's guard: which stage is running, and what an exception that leaves the run means.

``Trainer.train()`` runs inside ``guard.run(checkpoints)``, and each part of it inside a stage
(``with guard.stage("saving", where=checkpoints):``; within a step ``with guard.stage("rollout"):``). The
stages are the only bookkeeping there is: an exception that leaves the run is classified once, here, by the
stages it left:

- a stop signal — its KeyboardInterrupt, or whatever it became on the way out (DCP wraps it in a
  CheckpointException; a stopping peer breaks a collective) — becomes ``RunStopped`` with the stop line; a
  checkpoint being written was abandoned (only complete ones are ever loaded);
- a collective broken by a dead peer is the peer's end, not a fault here: its line, then this process exits;
- a fault of the machine (:mod:`polyrl.core.run.faults`, device memory) becomes ``RunFault``: one line with the
  cause, where the run was (``at step 7``, ``while saving step 6``), what to do, and the step the same command
  resumes from;
- ``TrainingAborted`` leaves as it is (one that says it is ``resumable`` — a refused weight sync — with the step
  the same command resumes from), and anything else keeps its traceback (a bug should be seen as one).

Device memory is worded here too: the stage of the step that ran out, the recipe key that sizes it, and what
the dry-run plan predicted for it (``plan``: the trainer's, given as a function, made only when needed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

from polyrl.core import distributed as D
from polyrl.core.config import RunConfig
from polyrl.core.distributed import launch as L
from polyrl.core.distributed.process import exit_if_a_peer_is_gone
from polyrl.core.run.faults import fault_line
from polyrl.core.run.outcome import RunFault, RunStopped, TrainingAborted, resume_point, stopped_message

# The run's stages and what a fault's line says the run was doing in each: ``{next}`` is the step being run,
# ``{step}`` the last one completed (read when the stage begins).
RUN_STAGES: dict[str, str] = {
    "opening": "while opening the run directory",
    "resuming": "while resuming",
    "step": "at step {next}",
    "logging": "while logging step {step}",
    "saving": "while saving step {step}",
}
# The stages of a step, in the order they run; the out-of-memory line names the one that ran out.
STEP_STAGES: tuple[str, ...] = ("rollout", "log-probs", "critic update", "update", "weight sync")


class MemoryPlan(Protocol):
    """What the out-of-memory line reads of the dry-run plan (``polyrl.core.plan.plan_memory``)."""

    phases: Mapping[str, float]  # predicted peak GiB per phase ("rollout", "update", "critic update")
    usable_gib: float


@dataclasses.dataclass(frozen=True)
class _Stage:
    name: str
    doing: str | None  # a run stage's words ("at step 7"); None for a stage of the step
    where: str | os.PathLike[str] | None  # the path being written, named when an OSError names none


class RunGuard:
    """The stage being run and the classification of what leaves the run (module docstring).

    ``step()``: the steps completed so far (``TrainerState.step``); ``plan()``: the dry-run memory plan of this
    run, for the out-of-memory line (None: the line goes without it)."""

    def __init__(self, cfg: RunConfig, step: Callable[[], int], plan: Callable[[], MemoryPlan] | None = None) -> None:
        self.cfg, self._step, self._plan = cfg, step, plan
        self._stages: list[_Stage] = []
        self._left: tuple[_Stage, ...] = ()  # the stages the last exception left, innermost last

    @property
    def phase(self) -> str | None:
        """The stage of the step being run, None outside one."""
        return next((s.name for s in reversed(self._stages) if s.doing is None), None)

    @contextlib.contextmanager
    def stage(self, name: str, *, where: str | os.PathLike[str] | None = None) -> Iterator[None]:
        """Run the body as stage ``name`` (a key of ``RUN_STAGES`` or one of ``STEP_STAGES``)."""
        if name in RUN_STAGES:
            doing: str | None = RUN_STAGES[name].format(next=self._step() + 1, step=self._step())
        elif name in STEP_STAGES:
            doing = None
        else:
            raise ValueError(f"unknown stage {name!r} (run stages: {', '.join(RUN_STAGES)}; "
                             f"step stages: {', '.join(STEP_STAGES)})")
        self._left = ()  # an exception handled inside an earlier stage is no longer leaving
        self._stages.append(_Stage(name, doing, where))
        try:
            yield
        except BaseException:
            if not self._left:  # the innermost stage sees it first
                self._left = tuple(self._stages)
            raise
        finally:
            self._stages.pop()

    @contextlib.contextmanager
    def run(self, checkpoints: Path) -> Iterator[None]:
        """The run's body: what leaves it leaves as ``TrainingAborted``, ``RunFault`` or ``RunStopped``, or as
        itself when it is none of those (a bug). ``checkpoints``: where the same command would resume from."""
        self._stages.clear()
        self._left = ()
        try:
            yield
        except TrainingAborted as exc:
            if getattr(exc, "resumable", False):  # e.g. a refused weight sync: the run directory is intact
                raise type(exc)(f"{exc}; the same command {resume_point(checkpoints)}") from exc
            raise
        except BaseException as exc:
            signum = L.stop_signal()
            if signum is None and not isinstance(exc, KeyboardInterrupt):
                exit_if_a_peer_is_gone()
                line = self.fault_line(exc)
                if line is None:
                    raise
                raise RunFault(f"{line} and rerun: the same command {resume_point(checkpoints)}") from exc
            signum = signum or 2  # None: a KeyboardInterrupt raised by Python's own handler
            raise RunStopped(signum, stopped_message(L.signal_name(signum), self._step(), checkpoints)) from None
        finally:
            self._stages.clear()

    def fault_line(self, exc: BaseException) -> str | None:
        """``cause where-the-run-was (detail); what to do`` for a fault of the machine that left the stages
        ``exc`` left, None for anything else."""
        import torch

        run_stage = next((s for s in reversed(self._left) if s.doing is not None), None)
        doing = run_stage.doing if run_stage is not None else ""
        if isinstance(exc, torch.OutOfMemoryError):
            phase = next((s.name for s in reversed(self._left) if s.doing is None), None)
            return self.out_of_memory_line(phase, doing)
        return fault_line(exc, doing, run_stage.where if run_stage is not None else None)

    def out_of_memory_line(self, phase: str | None, doing: str) -> str:
        """Device memory ran out in ``phase`` (a stage of the step; None: outside one): the micro-batch size in
        use, the recipe key to lower, and what the dry-run plan predicted for that phase (when it can be made)."""
        cfg, phase = self.cfg, phase or "step"
        said: list[str] = []  # in parentheses after the cause
        if phase == "rollout":
            seqs = cfg.data.batch_size // D.get_world_size() * cfg.rollout.n  # this rank's sequences of a batch
            size = cfg.rollout.micro_batch_size if 0 < cfg.rollout.micro_batch_size < seqs else seqs
            said.append(f"rollout.micro_batch_size={cfg.rollout.micro_batch_size}: {size} sequences generated "
                        "together")
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
            plan = self._plan() if self._plan is not None else None
            if plan is not None and peak in plan.phases:
                said.append(f"the dry-run plan predicted a peak of {plan.phases[peak]:.2f} GiB in the {peak}, "
                            f"{plan.usable_gib:.1f} GiB usable")
        except Exception:  # the plan is a hint: the line stands without it
            pass
        return f"device out of memory in the {phase} {doing}{' (' + '; '.join(said) + ')' if said else ''}; {todo}"
