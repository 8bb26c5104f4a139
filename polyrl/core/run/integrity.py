"""Checkpoint integrity: what ``COMPLETE`` records at save time, and the verification done before a load.

At save time every file of a checkpoint is hashed while it is written (DCP's shards and ``.metadata``
through a file system wrapper that feeds each written buffer to the hash; ``extra/rank_<r>.pt`` from the
bytes polyrl writes itself), so no file is read back. Rank 0 writes the union into ``COMPLETE``::

    {"step": 4, "world_size": 2, "time": ..., "hash": "sha256",
     "files": {".metadata": {"size": 9120, "digest": "…"}, "__0_0.distcp": {...}, "extra/rank_0.pt": {...}, ...},
     "self": "<sha256 of the marker's other keys, canonical JSON>"}

Before anything is loaded, ``verify`` checks, in this order: the marker (valid JSON whose own digest
matches), that every recorded file exists with its recorded size (a truncated shard is named before a
byte of it is parsed), every file's digest (split over the ranks: each hashes ``1/world`` of the files),
then the structure: DCP's ``.metadata`` read with the allow-listed unpickler, every byte range the index
names present in its shard, every per-rank file readable under ``torch.load(weights_only=True)``. A
problem is a ``CheckpointRefused`` naming the file and what is wrong; nothing has been unpickled beyond
the allow-lists by then, and no state has been touched.

Checkpoints written before the marker carried ``files`` ("legacy") get the structural checks only: the
marker, the presence of ``.metadata`` and of one per-rank file per writer rank, the shards' sizes against
DCP's index (catches truncation and missing shards) and the safe loaders. A changed byte inside a legacy
shard cannot be detected.

sha256 rather than blake2b: both are in the standard library, and with the SHA instructions of current
x86 and ARM server CPUs OpenSSL's sha256 hashed ~2x faster than blake2b on the development machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from polyrl.core.errors import BadInputError

COMPLETE_MARKER = "COMPLETE"
HASH = "sha256"
_CHUNK = 8 << 20  # bytes per read when hashing a file back


class CheckpointRefused(BadInputError):
    """A checkpoint that must not be loaded: ``file`` (a path) and ``problem`` (what is wrong)."""

    def __init__(self, file: str | os.PathLike[str], problem: str) -> None:
        self.file, self.problem = str(file), problem
        super().__init__(f"{self.file}: {problem}")


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


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle names a global outside the allow-list (it is never looked up, let alone called)."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickler for DCP's ``.metadata`` that refuses every global outside an allow-list."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _SAFE_META_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise RefusedGlobal(f"{module}.{name}")


def read_metadata(path: Path) -> Any:
    """DCP's ``.metadata`` through the allow-listed unpickler; ``CheckpointRefused`` names the file."""
    try:
        with open(path, "rb") as f:
            return MetadataUnpickler(f).load()
    except RefusedGlobal as exc:
        raise CheckpointRefused(path, f"references {exc}, which polyrl refuses to load (not DCP metadata)") from None
    except FileNotFoundError:
        raise CheckpointRefused(path, "missing") from None
    except Exception as exc:  # a truncated or garbled pickle: any of a dozen exception types
        raise CheckpointRefused(path, f"unreadable DCP metadata ({_one_line(exc)})") from None


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def load_extra(path: Path) -> Any:
    """A per-rank ``extra/rank_<r>.pt`` under ``torch.load(weights_only=True)``; errors name the file."""
    import torch

    try:
        return torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise CheckpointRefused(path, "missing") from None
    except pickle.UnpicklingError as exc:
        found = _GLOBAL_RE.search(str(exc))
        what = f"references {found.group(1)}" if found else "holds a pickled object"
        raise CheckpointRefused(path, f"{what}, which polyrl refuses to load (weights_only)") from None
    except Exception as exc:
        raise CheckpointRefused(path, f"unreadable ({_one_line(exc)})") from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


# --- hashing while writing ---------------------------------------------------------------------------
class _HashingStream:
    """A write stream that hashes every byte it passes on. Any seek away from the end voids the digest
    (the file is then hashed back after the save)."""

    def __init__(self, raw: Any) -> None:
        self._raw, self._hash, self._pos, self._valid = raw, hashlib.new(HASH), 0, True

    def write(self, data: Any) -> int:
        n = self._raw.write(data)
        view = memoryview(data).cast("B")
        self._hash.update(view if n is None or n == len(view) else view[:n])
        self._pos += len(view) if n is None else n
        return len(view) if n is None else n

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        pos = self._raw.seek(offset, whence)
        if pos != self._pos:
            self._valid = False
        return pos

    def seekable(self) -> bool:
        return self._raw.seekable()

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # fileno, flush, close, closed, ...
        return getattr(self._raw, name)

    def result(self) -> tuple[int, str] | None:
        return (self._pos, self._hash.hexdigest()) if self._valid else None


def hashing_storage_writer(path: Path) -> tuple[Any, dict[str, tuple[int, str] | None]]:
    """A DCP ``FileSystemWriter`` for ``path`` that hashes the files it writes, and the dict (file name ->
    (size, digest), or None when the digest was voided) it fills."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    written: dict[str, tuple[int, str] | None] = {}

    class HashingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                hashing = _HashingStream(stream)
                yield hashing
                written[Path(path).name] = hashing.result()

        def rename(self, path: Any, new_path: Any) -> None:
            super().rename(path, new_path)
            if Path(path).name in written:  # DCP writes .metadata.tmp, then renames it
                written[Path(new_path).name] = written.pop(Path(path).name)

    writer = FileSystemWriter(str(path))
    writer.fs = HashingFileSystem()
    return writer, written


def digest_bytes(data: bytes | memoryview) -> dict[str, Any]:
    return {"size": len(data), "digest": hashlib.new(HASH, data).hexdigest()}


def digest_file(path: Path, algorithm: str = HASH) -> dict[str, Any]:
    """Size and digest of a file, read back in chunks (the fallback when no digest was taken on the way, and
    the verification before a load)."""
    h, size = hashlib.new(algorithm), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return {"size": size, "digest": h.hexdigest()}


def rank_file_records(step_dir: Path, rank: int, written: dict[str, tuple[int, str] | None]) -> dict[str, Any]:
    """Records of the DCP files this rank wrote (``__<rank>_*.distcp``; ``.metadata`` on rank 0): the
    digest taken while writing when it is valid and the size on disk agrees, else one read back."""
    names = sorted(p.name for p in step_dir.glob(f"__{rank}_*.distcp"))
    if rank == 0 and (step_dir / ".metadata").is_file():
        names.append(".metadata")
    out = {}
    for name in names:
        got = written.get(name)
        if got is not None and (step_dir / name).stat().st_size == got[0]:
            out[name] = {"size": got[0], "digest": got[1]}
        else:
            out[name] = digest_file(step_dir / name)
    return out


# --- the marker ---------------------------------------------------------------------------------------
def _self_digest(marker: dict[str, Any]) -> str:
    body = {k: v for k, v in marker.items() if k != "self"}
    return hashlib.new(HASH, json.dumps(body, sort_keys=True).encode()).hexdigest()


def marker_text(step: int, world_size: int, files: dict[str, Any], now: float) -> str:
    marker: dict[str, Any] = {"step": step, "world_size": world_size, "time": now, "hash": HASH,
                              "files": dict(sorted(files.items()))}
    marker["self"] = _self_digest(marker)
    return json.dumps(marker)


def read_marker(step_dir: Path) -> dict[str, Any]:
    path = step_dir / COMPLETE_MARKER
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointRefused(path, "missing (the checkpoint is incomplete)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointRefused(path, f"not a valid marker ({_one_line(exc)})") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("step"), int) \
            or not isinstance(marker.get("world_size"), int) or marker["world_size"] < 1:
        raise CheckpointRefused(path, "not a valid marker (no integer step and world_size)")
    if "files" in marker:
        if marker.get("self") != _self_digest(marker):
            raise CheckpointRefused(path, "corrupt (its own checksum does not match its contents)")
        if marker.get("hash") not in hashlib.algorithms_available or not isinstance(marker["files"], dict):
            raise CheckpointRefused(path, f"names an unknown hash {marker.get('hash')!r}")
    return marker


# --- verification -------------------------------------------------------------------------------------
def _safe_relative(step_dir: Path, name: str) -> Path:
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise CheckpointRefused(step_dir / COMPLETE_MARKER, f"names a file outside the checkpoint ({name!r})")
    return step_dir / rel


def _size_on_disk(path: Path, missing: str = "missing") -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise CheckpointRefused(path, missing) from None


def _check_size(path: Path, expected: int) -> None:
    size = _size_on_disk(path)
    if size < expected:
        raise CheckpointRefused(path, f"truncated: {size} bytes on disk, {expected} were written")
    if size != expected:
        raise CheckpointRefused(path, f"size changed: {size} bytes on disk, {expected} were written")


def _check_digest(path: Path, record: dict[str, Any], algorithm: str) -> None:
    if digest_file(path, algorithm)["digest"] != record.get("digest"):
        raise CheckpointRefused(path, f"checksum mismatch: the contents changed after it was written ({algorithm})")


def verify_files(step_dir: Path, marker: dict[str, Any], *, share: tuple[int, int] = (0, 1),
                 digests: bool = True) -> None:
    """Presence and sizes of every file the marker records (cheap: stat only), then (``digests``) the
    digests of this rank's share ``(rank, world)`` of them, several files at once (hashlib releases the
    GIL). Legacy markers: presence of ``.metadata`` and of the per-rank files."""
    files = marker.get("files")
    needed = [".metadata", *(f"extra/rank_{r}.pt" for r in range(marker["world_size"]))]
    if files is None:
        for name in needed:
            if not (step_dir / name).is_file():
                raise CheckpointRefused(step_dir / name, "missing")
        return
    for name in needed:
        if name not in files:
            raise CheckpointRefused(step_dir / name, f"not recorded in {COMPLETE_MARKER}")
    names = sorted(files)
    for name in names:
        record = files[name]
        if not isinstance(record, dict) or not isinstance(record.get("size"), int):
            raise CheckpointRefused(step_dir / COMPLETE_MARKER, f"corrupt record for {name!r}")
        _check_size(_safe_relative(step_dir, name), record["size"])
    if not digests:
        return
    rank, world = share
    mine = names[rank::world]
    threads = max(1, min(len(mine), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(threads) as pool:  # results in name order: the first bad file is reported
        for _ in pool.map(lambda name: _check_digest(step_dir / name, files[name], marker["hash"]), mine):
            pass


def verify_structure(step_dir: Path, marker: dict[str, Any]) -> Any:
    """DCP's index read safely, each byte range it names present, each per-rank file loadable under
    weights_only. Returns the DCP metadata."""
    meta = read_metadata(step_dir / ".metadata")
    storage = getattr(meta, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointRefused(step_dir / ".metadata", "not DCP metadata (no storage index)")
    needed: dict[str, int] = {}
    for info in storage.values():
        name = str(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[name] = max(needed.get(name, 0), end)
    for name, end in sorted(needed.items()):
        path = _safe_relative(step_dir, name)
        size = _size_on_disk(path, "missing (named by the checkpoint's .metadata)")
        if size < end:
            raise CheckpointRefused(path, f"truncated: {size} bytes on disk, the checkpoint's index needs {end}")
    for r in range(marker["world_size"]):
        load_extra(step_dir / "extra" / f"rank_{r}.pt")
    return meta


def describe_mismatch(meta: Any, flat: dict[str, Any]) -> str | None:
    """Why the checkpoint's entries cannot fill ``flat`` (a flattened DCP state dict of this run), or None.
    Names the first missing entry or the first tensor whose global shape differs."""
    have = getattr(meta, "state_dict_metadata", {}) or {}
    missing = [k for k in flat if k not in have]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return (f"has no entry {missing[0]!r}{more} that this run needs: the recipe (model, critic or optimizer) "
                "differs from the one that wrote it")
    for key, value in flat.items():
        shape = getattr(value, "shape", None)
        size = getattr(have[key], "size", None)
        if shape is not None and size is not None and tuple(size) != tuple(shape):
            return (f"entry {key!r} is {list(size)} in the checkpoint and {list(shape)} in this run: the recipe's "
                    "model differs from the one that wrote it")
    return None
