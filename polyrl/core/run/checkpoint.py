"""Checkpoints: DCP for model/optimizer state, per-rank files for the rest, atomic publication.

Layout under a run's ``checkpoints/`` directory::

    step_00000010/             a complete checkpoint
      .metadata, *.distcp      torch.distributed.checkpoint: model, optimizer, critic, critic_optimizer
      extra/rank_<r>.pt        per rank: RNG states, trainer state, LR scheduler states (weights_only-safe)
      COMPLETE                 JSON written last inside the directory: step, world size
    step_00000020.tmp/         being written (or left by a killed run): never loaded, deleted on next save
    latest                     text file naming the newest complete checkpoint; replaced last

Why this shape: DCP stores each rank's shards plus global metadata, so a checkpoint written by N
processes loads into M (it reshards on load), and with or without FSDP. Publication is a protocol, not
a hope: all ranks write into ``step_N.tmp``, barrier, rank 0 writes ``COMPLETE`` and renames the
directory (atomic on POSIX), then replaces ``latest`` (write a temp file + ``os.replace``). A kill at any
point leaves either the previous complete checkpoint or the new one, never a half. Loading picks the
newest directory that has ``COMPLETE`` and no ``.tmp`` suffix.

Nothing here unpickles arbitrary objects: tensors and extra files go through ``torch.load(...,
weights_only=True)``; DCP's own ``.metadata`` (a pickle) is read with an allow-listed unpickler that
accepts only DCP's metadata classes, torch sizes/dtypes and paths.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyrl.core import distributed as D
from polyrl.core.distributed.launch import check_lifeline
from polyrl.core.errors import BadInputError
from polyrl.core.run.directory import _fsync_dir, write_atomic

if TYPE_CHECKING:
    from torch import nn

    from polyrl.core.plugins.backend import Backend

log = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
LATEST_FILE = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")
# Test-only hooks: seconds to sleep after every file is written and before the checkpoint is published
# (optionally only for one step), so a test can SIGKILL the run while a checkpoint is being written.
# Never set them in real runs.
TEST_DELAY_ENV = "POLYRL_TEST_CHECKPOINT_DELAY_S"
TEST_DELAY_STEP_ENV = "POLYRL_TEST_CHECKPOINT_DELAY_STEP"  # test-only: delay only the save of this step

# Which state entries pair into one DCP (module, optimizer) group; the key names are the trainer's.
_MODULE_GROUPS = (("model", "optimizer"), ("critic", "critic_optimizer"))
# Entries saved per rank with torch.save (anything with state_dict()/load_state_dict()).
_EXTRA_KEYS = ("scheduler", "critic_scheduler", "trainer")


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


# --- safe reading ------------------------------------------------------------------------------------
_SAFE_META_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "torch": {"Size"},
    "torch._utils": {"_get_layout"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickler for DCP's ``.metadata`` that refuses every global outside an allow-list."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _SAFE_META_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise BadInputError(f"checkpoint metadata references {module}.{name}, which polyrl refuses to load")


def _safe_reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with open(Path(self.path) / name, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
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

    # Read the metadata once up front so a refused or corrupt file surfaces as a plain BadInputError
    # (inside dcp.load it would come back wrapped in a per-rank CheckpointException).
    meta = Path(path) / ".metadata"
    try:
        with open(meta, "rb") as f:
            _MetadataUnpickler(f).load()
    except BadInputError:
        raise
    except Exception as exc:
        raise BadInputError(f"cannot read checkpoint metadata {str(meta)!r}: {exc}") from exc
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
    """
    import torch
    import torch.distributed.checkpoint as dcp

    root = Path(ckpt_dir)
    final = root / step_dirname(step)
    tmp = root / (final.name + ".tmp")
    rank, world = D.get_rank(), D.get_world_size()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a run killed mid-write
    D.barrier()
    with _quiet_single_process():
        dcp.save(_dcp_state(state), checkpoint_id=str(tmp))
    extra = _extra_state(state, backend)
    (tmp / "extra").mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(extra, buf)
    _check_weights_only(buf, "trainer extra state")
    with open(tmp / "extra" / f"rank_{rank}.pt", "wb") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())
    delay = float(os.environ.get(TEST_DELAY_ENV, "0") or 0)
    delay_step = os.environ.get(TEST_DELAY_STEP_ENV)
    if delay > 0 and (not delay_step or int(delay_step) == step):
        time.sleep(delay)
    D.barrier()  # every rank's files are on disk before anyone publishes
    if rank == 0:
        check_lifeline()  # a worker whose launcher is gone publishes nothing
        marker = {"step": step, "world_size": world, "time": time.time()}
        _write_file_atomic(tmp / COMPLETE_MARKER, json.dumps(marker))
        if final.exists():  # re-saving a step after resuming from an older pointer
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_file_atomic(root / LATEST_FILE, final.name + "\n")
        if keep is not None and keep > 0:
            _prune(root, keep)
    D.barrier()
    return final


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


# --- load ---------------------------------------------------------------------------------------------
def load_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any], *, backend: Backend | None = None) -> int:
    """Load a complete checkpoint directory into ``state`` in place; collective. Returns its step.

    The world size may differ from the one that wrote it (DCP reshards model and optimizer). Per-rank
    state comes from this rank's file when it exists, else rank 0's; RNG is restored only on ranks that
    had a file (new ranks keep their own streams instead of cloning rank 0's).
    """
    import torch
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    if not is_complete(path):
        raise BadInputError(f"checkpoint {str(path)!r} is incomplete; refusing to load it")
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    sd = _dcp_state(state)
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
    extra = torch.load(own if own.is_file() else path / "extra" / "rank_0.pt", weights_only=True)
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


def load_latest_checkpoint(
    ckpt_dir: str | os.PathLike[str], state: Mapping[str, Any], *, backend: Backend | None = None
) -> int | None:
    """Resume from the newest complete checkpoint under ``ckpt_dir``; None when there is none.

    Rank 0 chooses and broadcasts the choice, so every rank loads the same step even if a directory
    appears between two ranks' scans.
    """
    found = latest_checkpoint(ckpt_dir) if D.get_rank() == 0 else None
    found = D.broadcast_object(str(found) if found is not None else None)
    if found is None:
        return None
    step = load_checkpoint(found, state, backend=backend)
    log.info("resumed from %s (step %d)", found, step)
    return step


def load_model_weights(path: str | os.PathLike[str], model: nn.Module, key: str = "model") -> None:
    """Load only the weights of ``model`` (no optimizer) from a checkpoint directory: for export and eval."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    sd = {key: get_model_state_dict(model)}
    dcp_load(sd, path)
    set_model_state_dict(model, sd[key])
