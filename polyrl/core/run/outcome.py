"""What a run tells the user when it ends before its last step: the stop line and where a rerun resumes.

``stopped by SIGTERM at step 7; the same command resumes from step 6`` — the step is the last one logged
(or "while starting"), the resume point the newest complete checkpoint (rerunning the same command loads it).
"""

from __future__ import annotations

from pathlib import Path

from polyrl.core.errors import BadInputError
from polyrl.core.run.checkpoint import latest_checkpoint
from polyrl.core.run.report import read_metrics


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
