"""Checkpoints: DCP for model/optimizer state, per-rank files for the rest, atomic publication.

Layout under a run's ``checkpoints/`` directory::

    step_00000010/             a complete checkpoint
      .metadata, *.distcp      torch.distributed.checkpoint: model, optimizer, critic, critic_optimizer
      extra/rank_<r>.pt        per rank: RNG states, trainer state, LR scheduler states (weights_only-safe)
      COMPLETE                 JSON written last inside the directory: step, world size, and each
                               file's size and sha256 (polyrl.core.run.integrity)
    step_00000020.tmp/         being written (or left by a killed run): never loaded, deleted on next save
    latest                     text file naming the newest complete checkpoint; replaced last
    superseded-<time>/         checkpoints newer than one resumed from with ``--resume-from`` (kept, never loaded)

Why this shape: DCP stores each rank's shards plus global metadata, so a checkpoint written by N
processes loads into M (it reshards on load), and with or without FSDP. Publication is a protocol, not
a hope: all ranks write into ``step_N.tmp``, barrier, rank 0 writes ``COMPLETE`` and renames the
directory (atomic on POSIX), then replaces ``latest`` (write a temp file + ``os.replace``). A kill at any
point leaves either the previous complete checkpoint or the new one, never a half. Loading picks the
newest directory that has ``COMPLETE`` and no ``.tmp`` suffix, verifies it before touching any state
(sizes, checksums, structure, fit to this run's model: ``verify_checkpoint``), and refuses a checkpoint
that fails with one line naming the file and the newest earlier checkpoint that verifies. Falling back
to that one is the user's decision (``--resume-from``), never taken silently.

Nothing here unpickles arbitrary objects: tensors and extra files go through ``torch.load(...,
weights_only=True)``; DCP's own ``.metadata`` (a pickle) is read with an allow-listed unpickler that
accepts only DCP's metadata classes, torch sizes/dtypes and paths.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyrl.core import distributed as D
from polyrl.core.distributed.launch import check_lifeline, stop_signal
from polyrl.core.errors import BadInputError
from polyrl.core.run.directory import _fsync_dir, write_atomic
from polyrl.core.run.faults import NotEnoughSpace, dir_bytes, expected_bytes, free_bytes, is_out_of_space
from polyrl.core.run.integrity import (
    COMPLETE_MARKER,
    CheckpointRefused,
    MetadataUnpickler,
    describe_mismatch,
    digest_bytes,
    hashing_storage_writer,
    load_extra,
    marker_text,
    rank_file_records,
    read_marker,
    read_metadata,
    verify_files,
    verify_structure,
)

if TYPE_CHECKING:
    from torch import nn

    from polyrl.core.plugins.backend import Backend

log = logging.getLogger(__name__)

LATEST_FILE = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")
# Test-only hooks: seconds to sleep after every file is written and before the checkpoint is published
# (optionally only for one step), so a test can SIGKILL the run while a checkpoint is being written.
# Never set them in real runs.
TEST_DELAY_ENV = "POLYRL_TEST_CHECKPOINT_DELAY_S"
TEST_DELAY_STEP_ENV = "POLYRL_TEST_CHECKPOINT_DELAY_STEP"  # test-only: delay only the save of this step
# Set by the `--nproc` launcher for its workers: "<step dir>:<marker digest>" of the checkpoint it verified.
VERIFIED_ENV = "POLYRL_CHECKPOINT_VERIFIED"

# Which state entries pair into one DCP (module, optimizer) group; the key names are the trainer's.
_MODULE_GROUPS = (("model", "optimizer"), ("critic", "critic_optimizer"))
# Entries saved per rank with torch.save (anything with state_dict()/load_state_dict()).
_EXTRA_KEYS = ("scheduler", "critic_scheduler", "trainer")


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


# --- safe reading ------------------------------------------------------------------------------------
def _safe_reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with open(Path(self.path) / name, "rb") as f:
                metadata = MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


def _safe_planner() -> Any:
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP stores non-tensor values (optimizer hyper-parameters) as torch.save bytes; read them safely."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()


def dcp_load(state_dict: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """``dcp.load`` in place, with the safe reader and planner. Works with or without a process group."""
    import torch.distributed.checkpoint as dcp

    # Read the metadata once up front so a refused or corrupt file surfaces as a plain CheckpointRefused
    # (inside dcp.load it would come back wrapped in a per-rank CheckpointException).
    read_metadata(Path(path) / ".metadata")
    with _quiet_single_process():
        dcp.load(state_dict, storage_reader=_safe_reader(Path(path)), planner=_safe_planner())


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every call without a process group that it assumes a single process: that is our
    # intended single-process mode, not news.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# --- RNG ---------------------------------------------------------------------------------------------
def rng_state(backend: Backend | None = None) -> dict[str, Any]:
    """Every RNG the loop may draw from, in weights_only-loadable types (tensors, ints, lists).

    The device's default generator is asked of the backend and tagged with its device type: a checkpoint
    restores it only on a device of the same type (a CUDA generator state means nothing to an NPU)."""
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "torch": torch.get_rng_state(),
    }
    device_state = backend.device_rng_state() if backend is not None else None
    if device_state is not None:
        state["device"] = {"type": backend.device_type, "state": device_state}
    return state


def set_rng_state(state: Mapping[str, Any], backend: Backend | None = None) -> None:
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    torch.set_rng_state(state["torch"])
    saved = state.get("device")
    if backend is not None and isinstance(saved, Mapping) and saved.get("type") == backend.device_type:
        backend.set_device_rng_state(saved["state"])


# --- finding checkpoints ------------------------------------------------------------------------------
def is_complete(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return _STEP_RE.match(p.name) is not None and (p / COMPLETE_MARKER).is_file() and (p / ".metadata").is_file()


def list_checkpoints(ckpt_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``ckpt_dir`` as (step, path), oldest first. Partial ones are ignored."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
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
    if _STEP_RE.match(p.name) or p.name.endswith(".tmp"):
        if not is_complete(p):
            raise BadInputError(f"checkpoint {str(p)!r} is incomplete (no {COMPLETE_MARKER} marker); refusing it")
        return p
    for root in (p, p / "checkpoints"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise BadInputError(f"no complete checkpoint under {str(p)!r}")


# --- save ---------------------------------------------------------------------------------------------
def _dcp_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """{"model": ..., "optimizer": ..., "critic": ..., "critic_optimizer": ...} as DCP state dicts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out: dict[str, Any] = {}
    for module_key, optim_key in _MODULE_GROUPS:
        module = state.get(module_key)
        if module is None:
            continue
        optim = state.get(optim_key)
        msd, osd = get_state_dict(module, optim if optim is not None else [])
        out[module_key] = msd
        if optim is not None:
            out[optim_key] = osd
    return out


def _extra_state(state: Mapping[str, Any], backend: Backend | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"rng": rng_state(backend)}
    for key in _EXTRA_KEYS:
        obj = state.get(key)
        if obj is not None:
            extra[key] = obj.state_dict()
    return extra


def _write_file_atomic(path: Path, text: str) -> None:
    write_atomic(path, text)  # the run directory's atomic replace (fsynced file, then its directory)


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
    sd = _dcp_state(state)
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
    with _quiet_single_process():
        dcp.save(sd, storage_writer=writer)
    extra = _extra_state(state, backend)
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
        _write_file_atomic(tmp / COMPLETE_MARKER, marker_text(step, world, records, time.time()))
        if final.exists():  # re-saving a step after resuming from an older pointer
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_file_atomic(root / LATEST_FILE, final.name + "\n")
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


# --- verification -------------------------------------------------------------------------------------
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
        named = _STEP_RE.match(path.name)
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


RESUME_HOW = "to resume from it, run the same command with --resume-from {name}"
RESUME_NONE = ": to start over, run with another --output"


# --- load ---------------------------------------------------------------------------------------------
def load_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any], *, backend: Backend | None = None) -> int:
    """Verify, then load a complete checkpoint directory into ``state`` in place; collective. Returns its step.

    Nothing in ``state`` is touched before ``verify_checkpoint`` has passed (a problem raises
    ``CheckpointRefused``). The world size may differ from the one that wrote it (DCP reshards model and
    optimizer). Per-rank state comes from this rank's file when it exists, else rank 0's; RNG is restored
    only on ranks that had a file (new ranks keep their own streams instead of cloning rank 0's).
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    if not is_complete(path):
        raise BadInputError(f"checkpoint {str(path)!r} is incomplete; refusing to load it")
    sd = _dcp_state(state)
    marker = verify_checkpoint(path, sd)
    dcp_load(sd, path)
    for module_key, optim_key in _MODULE_GROUPS:
        if module_key in sd:
            optim = state.get(optim_key)
            set_state_dict(
                state[module_key],
                optim if optim is not None else [],
                model_state_dict=sd[module_key],
                optim_state_dict=sd.get(optim_key, {}),
            )
    rank = D.get_rank()
    own = path / "extra" / f"rank_{rank}.pt"
    extra = load_extra(own if own.is_file() else path / "extra" / "rank_0.pt")
    for key in _EXTRA_KEYS:
        if state.get(key) is not None and key in extra:
            state[key].load_state_dict(extra[key])
    if own.is_file():
        set_rng_state(extra["rng"], backend)
    else:
        # A rank that did not exist when the checkpoint was written keeps its own (seed-derived) RNG
        # rather than cloning rank 0's stream.
        log.warning("checkpoint written by %s processes has no RNG state for rank %d", marker.get("world_size"), rank)
    return int(marker["step"])


def resolve_resume_from(ckpt_dir: str | os.PathLike[str], spec: str) -> Path:
    """The step directory ``--resume-from`` names: ``step_N``, ``N`` or a path to a step directory of this
    run's ``checkpoints/``. A missing or incomplete one is bad input naming the complete ones."""
    root = Path(ckpt_dir)
    m = re.fullmatch(r"(?:step_)?(\d+)", spec.strip())
    if m:
        chosen = root / step_dirname(int(m.group(1)))
    else:
        chosen = Path(spec)
        if not _STEP_RE.match(chosen.name) or chosen.resolve().parent != root.resolve():
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
    _write_file_atomic(root / LATEST_FILE, step_dirname(step) + "\n")
    return moved


def load_latest_checkpoint(
    ckpt_dir: str | os.PathLike[str], state: Mapping[str, Any], *, backend: Backend | None = None,
    resume_from: str | None = None,
) -> int | None:
    """Resume from the newest complete checkpoint under ``ckpt_dir`` (or the one ``resume_from`` names);
    None when there is none. Collective.

    Rank 0 chooses and broadcasts the choice, so every rank loads the same step even if a directory
    appears between two ranks' scans. A checkpoint that fails verification is never skipped silently:
    the error names the file, what is wrong, and the newest earlier checkpoint that verifies. After
    resuming from a chosen earlier checkpoint, the newer ones are set aside (``set_aside_newer``).
    """
    choice: tuple[str | None, str | None] = (None, None)  # (path, error)
    if D.get_rank() == 0:
        try:
            found = resolve_resume_from(ckpt_dir, resume_from) if resume_from else latest_checkpoint(ckpt_dir)
            choice = (str(found) if found is not None else None, None)
        except BadInputError as exc:
            choice = (None, str(exc))
    found, error = D.broadcast_object(choice)
    if error is not None:
        raise BadInputError(error)
    if found is None:
        return None
    try:
        step = load_checkpoint(found, state, backend=backend)
    except CheckpointRefused as exc:
        raise refusal(exc, ckpt_dir, int(Path(found).name.split("_")[1]), RESUME_HOW, _dcp_state(state),
                      RESUME_NONE) from None
    log.info("resumed from %s (step %d)", found, step)
    if resume_from and D.get_rank() == 0:
        for moved in set_aside_newer(ckpt_dir, step):
            log.warning("checkpoint %s is newer than the one resumed from: set aside as %s (delete it when no "
                        "longer needed)", moved.name, moved)
    D.barrier()
    return step


def load_model_weights(path: str | os.PathLike[str], model: nn.Module, key: str = "model") -> None:
    """Verify, then load only the weights of ``model`` (no optimizer) from a checkpoint directory: for
    export and eval. Raises ``CheckpointRefused`` before touching ``model`` when the checkpoint fails."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    sd = {key: get_model_state_dict(model)}
    verify_checkpoint(path, sd)
    dcp_load(sd, path)
    set_model_state_dict(model, sd[key])
