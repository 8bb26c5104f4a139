"""Where checkpoints live under a run's ``checkpoints/``: ``step_N`` directories (complete when their ``COMPLETE``
marker and DCP ``.metadata`` are there), the ``latest`` pointer, the ``superseded-<time>/`` directories, and how
a checkpoint is named on the command line (``--resume-from``, ``polyrl export``)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from polyrl.core.errors import BadInputError
from polyrl.core.run.directory import _fsync_dir, write_atomic
from polyrl.core.run.integrity import COMPLETE_MARKER

LATEST_FILE = "latest"
STEP_RE = re.compile(r"^step_(\d+)$")


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return STEP_RE.match(p.name) is not None and (p / COMPLETE_MARKER).is_file() and (p / ".metadata").is_file()


def list_checkpoints(ckpt_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``ckpt_dir`` as (step, path), oldest first. Partial ones are ignored."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = STEP_RE.match(child.name)
        if m and child.is_dir() and is_complete(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(ckpt_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint. The ``latest`` pointer is advisory (it moves last, so it can lag
    a just-renamed directory after a kill); the scan is the truth and never returns a partial one."""
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A complete step directory from either itself or a checkpoints root (for export)."""
    p = Path(path)
    if not p.exists():
        raise BadInputError(f"checkpoint {str(p)!r} does not exist")
    if STEP_RE.match(p.name) or p.name.endswith(".tmp"):
        if not is_complete(p):
            raise BadInputError(f"checkpoint {str(p)!r} is incomplete (no {COMPLETE_MARKER} marker); refusing it")
        return p
    for root in (p, p / "checkpoints"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise BadInputError(f"no complete checkpoint under {str(p)!r}")


def resolve_resume_from(ckpt_dir: str | os.PathLike[str], spec: str) -> Path:
    """The step directory ``--resume-from`` names: ``step_N``, ``N`` or a path to a step directory of this
    run's ``checkpoints/``. A missing or incomplete one is bad input naming the complete ones."""
    root = Path(ckpt_dir)
    m = re.fullmatch(r"(?:step_)?(\d+)", spec.strip())
    if m:
        chosen = root / step_dirname(int(m.group(1)))
    else:
        chosen = Path(spec)
        if not STEP_RE.match(chosen.name) or chosen.resolve().parent != root.resolve():
            raise BadInputError(f"--resume-from {spec}: not a checkpoint of this run (step_N, N, or a step "
                                f"directory in {root})")
    if not is_complete(chosen):
        have = ", ".join(p.name for _, p in list_checkpoints(root)) or "none"
        raise BadInputError(f"--resume-from {spec}: no complete checkpoint {chosen.name} in {root} "
                            f"(complete ones: {have})")
    return chosen


def set_aside_newer(ckpt_dir: str | os.PathLike[str], step: int) -> list[Path]:
    """Move the checkpoints newer than ``step`` into ``superseded-<time>/`` (rank 0): after resuming from
    an earlier checkpoint they belong to another history, and the next plain resume must not pick them.
    Kept, not deleted: the user deletes them. ``latest`` is pointed at ``step``."""
    root = Path(ckpt_dir)
    newer = [p for s, p in list_checkpoints(root) if s > step]
    if not newer:
        return []
    aside = root / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(exist_ok=True)
    moved = []
    for path in newer:
        os.replace(path, aside / path.name)
        moved.append(aside / path.name)
    _fsync_dir(root)
    write_atomic(root / LATEST_FILE, step_dirname(step) + "\n")
    return moved
