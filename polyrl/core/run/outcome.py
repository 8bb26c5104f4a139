"""What a run tells the user when it ends before its last step: how it ended, the stop line, where a rerun resumes.

A run that ends early raises one of three exceptions, each with the user's one line: ``TrainingAborted`` (it
cannot go on: non-finite updates in a row, dynamic sampling exhausted), ``RunFault`` (a fault of the machine,
:mod:`polyrl.core.run.faults`), ``RunStopped`` (a stop signal). :mod:`polyrl.core.run.guard` decides which.

``stopped by SIGTERM at step 7; the same command resumes from step 6`` — the step is the last one logged
(or "while starting"), the resume point the newest complete checkpoint (rerunning the same command loads it).
"""

from __future__ import annotations

from pathlib import Path

from polyrl.core.errors import BadInputError
from polyrl.core.run.checkpoint import latest_checkpoint
from polyrl.core.run.report import read_metrics


class TrainingAborted(RuntimeError):
    """The run cannot continue (non-finite updates in a row, dynamic sampling exhausted, a fault of the machine:
    the run's guard turns a :mod:`polyrl.core.run.faults` fault into one); the message is the user's one line."""


class RunFault(TrainingAborted):
    """A fault of the machine met by this process (a full disk, device memory, a failing engine); other ranks
    may not have met it, so the process ends without waiting for them (their peer watch stops them)."""


class RunStopped(Exception):
    """A stop signal (SIGINT/SIGTERM/SIGHUP) ended the run; ``message`` is the one line for the user."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum, self.message = signum, message


def resume_point(checkpoints: Path | None) -> str:
    """``resumes from step N`` (the newest complete checkpoint) or ``starts over (no checkpoint yet)``."""
    found = latest_checkpoint(checkpoints) if checkpoints is not None else None
    return f"resumes from step {int(found.name.split('_')[1])}" if found else "starts over (no checkpoint yet)"


def stopped_message(signame: str, step: int | str | None, checkpoints: Path | None) -> str:
    """``stopped by SIGTERM at step 7; the same command resumes from step 6`` (step None: while starting)."""
    where = "while starting" if step is None else f"at step {step}"
    return f"stopped by {signame} {where}; the same command {resume_point(checkpoints)}"


def last_logged_step(run_dir: Path) -> int | str:
    """The last step in the run's metrics.jsonl (0 when there is none yet); "?" when it cannot be read."""
    if not (run_dir / "metrics.jsonl").is_file():
        return 0
    try:
        records, _ = read_metrics(run_dir)
    except BadInputError:
        return "?"
    return int(records[-1]["step"]) if records else 0
