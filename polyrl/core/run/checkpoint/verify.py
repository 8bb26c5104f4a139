"""Verifying a checkpoint before anything is loaded from it (sizes, checksums, structure, fit to this run's model),
and the one-line refusal that names the bad file and the newest earlier checkpoint that verifies."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from polyrl.core import distributed as D
from polyrl.core.errors import BadInputError
from polyrl.core.run.checkpoint.layout import STEP_RE, latest_checkpoint, list_checkpoints, resolve_resume_from
from polyrl.core.run.integrity import (
    COMPLETE_MARKER,
    CheckpointRefused,
    describe_mismatch,
    read_marker,
    read_metadata,
    verify_files,
    verify_structure,
)

# Set by the `--nproc` launcher for its workers: "<step dir>:<marker digest>" of the checkpoint it verified.
VERIFIED_ENV = "POLYRL_CHECKPOINT_VERIFIED"
RESUME_HOW = "to resume from it, run the same command with --resume-from {name}"
RESUME_NONE = ": to start over, run with another --output"


def _flatten(sd: Mapping[str, Any], meta: Any) -> dict[str, Any]:
    """``sd`` keyed as DCP keys it in ``.metadata`` ("model.layers.0.mlp.weight", "optimizer.state...")."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    planner = DefaultLoadPlanner()
    planner.set_up_planner(dict(sd), meta, False)
    return planner.state_dict


def verify_checkpoint(path: str | os.PathLike[str], sd: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Check a checkpoint before anything is loaded from it; collective. Returns its marker.

    Every rank stats every recorded file and hashes its share of them; rank 0 checks the structure (DCP's
    index read safely, each byte range present, each per-rank file loadable under weights_only); with
    ``sd`` (this run's DCP state dicts) every rank checks that the checkpoint has each entry in its shape.
    Raises ``CheckpointRefused`` (the same on every rank) naming the first bad file and what is wrong.
    """
    path = Path(path)
    rank, world = D.get_rank(), D.get_world_size()

    def agree(check: Any) -> Any:
        try:
            result, problem = check(), None
        except CheckpointRefused as exc:
            result, problem = None, (exc.file, exc.problem)
        first = next((p for p in D.all_gather_object(problem) if p is not None), None)
        if first is not None:
            raise CheckpointRefused(*first)
        return result

    def files() -> dict[str, Any]:
        marker = read_marker(path)
        named = STEP_RE.match(path.name)
        if named and int(named.group(1)) != marker["step"]:  # a directory copied or renamed from elsewhere
            raise CheckpointRefused(path / COMPLETE_MARKER, f"records step {marker['step']}, not this directory's "
                                                            f"step {int(named.group(1))}")
        verify_files(path, marker, share=(rank, world), digests=not _verified_by_launcher(path, marker))
        if rank == 0:
            verify_structure(path, marker)
        return marker

    def fits() -> None:
        meta = read_metadata(path / ".metadata")
        why = describe_mismatch(meta, _flatten(sd, meta))
        if why is not None:
            raise CheckpointRefused(path / ".metadata", why)

    marker = agree(files)
    if sd is not None:
        agree(fits)
    return marker


def _verified_by_launcher(path: Path, marker: Mapping[str, Any]) -> bool:
    """The ``--nproc`` launcher hashed this very checkpoint (same directory, same marker) just before it
    started the workers (``check_resume``): the workers then skip the digests, not the other checks."""
    return bool(marker.get("self")) and os.environ.get(VERIFIED_ENV) == f"{path.resolve()}:{marker['self']}"


def check_resume(ckpt_dir: str | os.PathLike[str], resume_from: str | None = None) -> None:
    """What a resume would load, verified in one process without the model (the ``--nproc`` launcher,
    before it starts workers, so that a refusal is one line from one process). The model's fit is
    checked by the workers."""
    found = resolve_resume_from(ckpt_dir, resume_from) if resume_from else latest_checkpoint(ckpt_dir)
    if found is None:
        return
    try:
        marker = verify_checkpoint(found)
    except CheckpointRefused as exc:
        raise refusal(exc, ckpt_dir, int(found.name.split("_")[1]), RESUME_HOW, None, RESUME_NONE) from None
    os.environ[VERIFIED_ENV] = f"{found.resolve()}:{marker.get('self', '')}"


def newest_verified_before(ckpt_dir: str | os.PathLike[str], step: int,
                           sd: Mapping[str, Any] | None = None) -> Path | None:
    """The newest complete checkpoint older than ``step`` that passes ``verify_checkpoint``; collective."""
    found = [str(p) for s, p in list_checkpoints(ckpt_dir) if s < step] if D.get_rank() == 0 else None
    for candidate in reversed(D.broadcast_object(found)):
        try:
            verify_checkpoint(candidate, sd)
        except CheckpointRefused:
            continue
        return Path(candidate)
    return None


def refusal(exc: CheckpointRefused, ckpt_dir: str | os.PathLike[str], step: int, how: str,
            sd: Mapping[str, Any] | None = None, none_how: str = "") -> BadInputError:
    """The one-line refusal: the bad file, what is wrong, and the newest earlier checkpoint that verifies
    (and fits ``sd``), with ``how`` (a format string of ``{name}`` and ``{path}``) saying how to use it, or
    ``none_how`` when there is none; collective."""
    earlier = newest_verified_before(ckpt_dir, step, sd)
    if earlier is None:
        tail = "no earlier checkpoint verifies" + (" and fits this run" if sd is not None else "") + none_how
    else:
        tail = f"the newest earlier checkpoint that verifies is {earlier.name}: " + how.format(
            name=earlier.name, path=earlier)
    return BadInputError(f"{exc}; {tail}")


