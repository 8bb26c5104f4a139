"""Saving a checkpoint: every rank writes into ``step_N.tmp`` (each file hashed as it is written), barrier, rank 0
writes ``COMPLETE`` and renames the directory (atomic on POSIX), then replaces ``latest``; refused before writing
when the file system cannot take it, a failed save removes its partial directory (polyrl.core.run.faults)."""

from __future__ import annotations

import io
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyrl.core import distributed as D
from polyrl.core.distributed.launch import check_lifeline, stop_signal
from polyrl.core.run.checkpoint.contents import dcp_state, extra_state
from polyrl.core.run.checkpoint.layout import LATEST_FILE, latest_checkpoint, list_checkpoints, step_dirname
from polyrl.core.run.checkpoint.reading import quiet_single_process
from polyrl.core.run.directory import _fsync_dir, write_atomic
from polyrl.core.run.faults import NotEnoughSpace, dir_bytes, expected_bytes, free_bytes, is_out_of_space
from polyrl.core.run.integrity import (
    COMPLETE_MARKER,
    digest_bytes,
    hashing_storage_writer,
    marker_text,
    rank_file_records,
)

if TYPE_CHECKING:
    from polyrl.core.plugins.backend import Backend

# Test-only hooks: seconds to sleep after every file is written and before the checkpoint is published
# (optionally only for one step), so a test can SIGKILL the run while a checkpoint is being written.
# Never set them in real runs.
TEST_DELAY_ENV = "POLYRL_TEST_CHECKPOINT_DELAY_S"
TEST_DELAY_STEP_ENV = "POLYRL_TEST_CHECKPOINT_DELAY_STEP"  # test-only: delay only the save of this step


def save_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    step: int,
    state: Mapping[str, Any],
    *,
    keep: int | None = None,
    backend: Backend | None = None,
) -> Path:
    """Write checkpoint ``step`` of ``state`` (the trainer's dict) under ``ckpt_dir``; collective.

    ``state`` keys: model, optimizer, critic, critic_optimizer (DCP), scheduler, critic_scheduler,
    trainer (objects with state_dict()). Absent or None entries are skipped. ``keep``: how many complete
    checkpoints to keep (None keeps all). Returns the published directory.

    Refused before writing (``NotEnoughSpace``) when the file system has less free space than the checkpoint
    takes (``faults.expected_bytes``); a failed save removes its ``step_N.tmp`` (``NotEnoughSpace`` when it
    failed for lack of space), earlier checkpoints untouched.
    """
    root = Path(ckpt_dir)
    final = root / step_dirname(step)
    tmp = root / (final.name + ".tmp")
    rank = D.get_rank()
    sd = dcp_state(state)
    space = None  # rank 0's (needed, free) when the file system cannot take this checkpoint
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a run killed mid-write
        needed = expected_bytes(sd, latest_checkpoint(root))
        free = free_bytes(root) + (dir_bytes(final) if final.exists() else 0)  # a re-saved step replaces its own
        space = (needed, free) if free < needed else None
    space = D.broadcast_object(space)  # every rank refuses together, before anyone writes
    what = f"checkpoint step {step}"
    if space is not None:
        raise NotEnoughSpace(root, what, *space, before=True)
    D.barrier()
    try:
        _write_and_publish(root, tmp, final, step, sd, state, keep, backend)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt) or stop_signal() is not None:
            raise  # the stop path: the partial directory is never loaded, and the next save removes it
        full = is_out_of_space(exc, root)  # looked at before the partial files go
        shutil.rmtree(tmp, ignore_errors=True)  # every rank (a shared directory): what one left, another removes
        if full:
            raise NotEnoughSpace(root, what, expected_bytes(sd, latest_checkpoint(root)), free_bytes(root),
                                 before=False) from exc
        raise
    return final


def _write_and_publish(root: Path, tmp: Path, final: Path, step: int, sd: dict[str, Any], state: Mapping[str, Any],
                       keep: int | None, backend: Backend | None) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    rank, world = D.get_rank(), D.get_world_size()
    writer, written = hashing_storage_writer(tmp)  # each file is hashed as it is written (integrity.py)
    with quiet_single_process():
        dcp.save(sd, storage_writer=writer, no_dist=not D.is_distributed())
    extra = extra_state(state, backend)
    (tmp / "extra").mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(extra, buf)
    _check_weights_only(buf, "trainer extra state")
    with open(tmp / "extra" / f"rank_{rank}.pt", "wb") as f:
        f.write(buf.getbuffer())
        f.flush()
        os.fsync(f.fileno())
    files = rank_file_records(tmp, rank, written)
    files[f"extra/rank_{rank}.pt"] = digest_bytes(buf.getbuffer())
    every_rank = D.all_gather_object(files)  # rank 0 records them all in COMPLETE
    delay = float(os.environ.get(TEST_DELAY_ENV, "0") or 0)
    delay_step = os.environ.get(TEST_DELAY_STEP_ENV)
    if delay > 0 and (not delay_step or int(delay_step) == step):
        time.sleep(delay)
    D.barrier()  # every rank's files are on disk before anyone publishes
    if rank == 0:
        check_lifeline()  # a worker whose launcher is gone publishes nothing
        records = {name: rec for per_rank in every_rank for name, rec in per_rank.items()}
        write_atomic(tmp / COMPLETE_MARKER, marker_text(step, world, records, time.time()))
        if final.exists():  # re-saving a step after resuming from an older pointer
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        write_atomic(root / LATEST_FILE, final.name + "\n")
        if keep is not None and keep > 0:
            _prune(root, keep)
    D.barrier()


def _check_weights_only(buf: io.BytesIO, what: str) -> None:
    """Fail at save time, naming the cause, if a state would not load under weights_only=True."""
    import torch

    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as exc:
        raise TypeError(f"{what} holds a type torch.load(weights_only=True) refuses: {exc}") from exc


def _prune(root: Path, keep: int) -> None:
    found = list_checkpoints(root)
    for _, path in found[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    newest = found[-1][0] if found else -1
    for child in root.iterdir():  # stale partial directories from killed runs, older than the newest
        m = re.match(r"^step_(\d+)\.tmp$", child.name)
        if m and int(m.group(1)) < newest:
            shutil.rmtree(child, ignore_errors=True)
