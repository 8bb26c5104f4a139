"""The run directory: ``config.yaml``, ``metrics.jsonl``, ``events/``, ``checkpoints/``, ``.lock``.

Nothing here is touched before the run's inputs have been validated: the CLI builds the trainer first
(where bad input raises) and only then locks the directory and calls ``RunDir.open``. Rank 0 alone writes
files; other ranks get a RunDir whose writers do nothing.

One live run per directory: a live run holds an exclusive ``flock`` on ``<run>/.lock`` (``RunLock``). The
kernel releases it when the holder dies, however it dies, so no stale lock outlives a crash; the file
itself stays and names the last holder (pid, host, start time). A second run on a held directory is bad
input: ``RunDirLocked`` (exit 2, one line), raised before anything in the directory is written.

``metrics.jsonl`` holds one JSON object per step (``step``, ``reward/mean``, ``loss/policy``,
``time/step_s``, ...), each step once. On open the file is cut back to the steps the run resumes from
(rewritten atomically: a temp file, then ``os.replace``), and the TensorBoard events are rebuilt from what
is left, so neither ever shows a step twice or a step the resumed run has not replayed yet. Events are
written when ``tensorboard`` is installed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyrl.core.errors import BadInputError

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
EVENTS_DIR = "events"
CHECKPOINTS_DIR = "checkpoints"
LOCK_FILE = ".lock"


def default_run_dir(recipe_name: str) -> Path:
    return Path("runs") / f"{recipe_name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf: keep it readable instead of invalid
    return value


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a reader (or a crash) sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# --- one live run per directory ---------------------------------------------------------------------------
class RunDirLocked(BadInputError):
    """Another live run holds the directory."""


def _holder(lock_path: Path, tries: int = 10) -> dict[str, Any]:
    """The holder's record (pid, host, since); it may be being written: retry briefly."""
    for _ in range(tries):
        try:
            record = json.loads(lock_path.read_text(encoding="utf-8"))
            if isinstance(record, dict) and "pid" in record:
                return record
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return {}


def _locked_error(run_dir: Path, holder: dict[str, Any]) -> RunDirLocked:
    who = (f"pid {holder.get('pid')} on host {holder.get('host', '?')}, since {holder.get('since', '?')}"
           if holder else "holder unknown")
    return RunDirLocked(f"run directory {run_dir} is in use by a live run ({who}); wait for it to end or stop "
                        "it, or choose another --output")


def check_unlocked(run_dir: str | os.PathLike[str]) -> None:
    """Raise ``RunDirLocked`` when a live run holds ``run_dir``. Creates and writes nothing (a quick look
    before the expensive setup; ``RunLock.acquire`` decides)."""
    import fcntl

    run_dir = Path(run_dir)
    lock_path = run_dir / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return  # no lock file (a fresh directory, or none at all): nobody holds it
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _locked_error(run_dir, _holder(lock_path)) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class RunLock:
    """The exclusive lock of a live run on its directory (``flock`` on ``<run>/.lock``).

    ``acquire`` creates the directory when needed and takes the lock, or raises ``RunDirLocked`` naming the
    holder. ``delegated_by=pid``: a torchrun worker of the launcher ``pid``, which already holds the lock
    for its workers; the lock counts as this run's when its holder is that launcher on this host (a
    worker must not wait on its own launcher's lock).
    """

    def __init__(self, run_dir: Path, fd: int | None, *, created_dir: bool, created_file: bool,
                 previous: bytes = b"") -> None:
        self.run_dir, self._fd = run_dir, fd
        self._created_dir, self._created_file = created_dir, created_file
        self._previous = previous  # the lock file's record before this holder wrote its own

    @property
    def held(self) -> bool:
        """True when this process holds the lock itself (False when its launcher does)."""
        return self._fd is not None

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike[str], *, delegated_by: int | None = None,
                tries: int = 10) -> RunLock:
        import fcntl

        run_dir = Path(run_dir)
        lock_path = run_dir / LOCK_FILE
        if run_dir.exists() and not run_dir.is_dir():
            raise BadInputError(f"run directory {run_dir} is a file, not a directory")
        created_dir = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            created_file = True
        except FileExistsError:
            fd = os.open(lock_path, os.O_RDWR)
            created_file = False
        try:
            for attempt in range(tries):  # a concurrent check_unlocked holds a shared lock for microseconds
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if attempt == tries - 1:
                        holder = _holder(lock_path)
                        if (delegated_by is not None and holder.get("pid") == delegated_by
                                and holder.get("host") == socket.gethostname()):
                            os.close(fd)
                            return cls(run_dir, None, created_dir=False, created_file=False)
                        raise _locked_error(run_dir, holder) from None
                    time.sleep(0.05)
            record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
            previous = b"" if created_file else os.pread(fd, 1 << 16, 0)
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(run_dir, fd, created_dir=created_dir, created_file=created_file, previous=previous)

    def release(self, *, undo: bool = False) -> None:
        """Release the lock. ``undo``: the run wrote nothing (bad input found late, e.g. a checkpoint that
        fails verification): remove the lock file and the directory when this lock created them, else put
        the previous holder's record back, so a refused run leaves every file as it found it."""
        if self._fd is None:
            return
        if undo and not self._created_file:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, self._previous, 0)
        if undo and self._created_file:
            with contextlib.suppress(OSError):
                (self.run_dir / LOCK_FILE).unlink()
            if self._created_dir:
                with contextlib.suppress(OSError):
                    self.run_dir.rmdir()  # only when empty
        os.close(self._fd)  # the kernel drops the flock with the last descriptor
        self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# --- metrics and events --------------------------------------------------------------------------------
def lock_run_dir(run_dir: str | os.PathLike[str], *, delegated_by: int | None = None) -> RunLock | None:
    """The run's lock, taken by rank 0 before the directory is read or written (or found held by this worker's
    launcher, ``delegated_by``); collective: every rank learns the outcome, so a refused run ends every rank
    with ``RunDirLocked``, not just rank 0. Returns rank 0's lock (None on other ranks)."""
    from polyrl.core import distributed as D

    lock, refused = None, None
    if D.is_main_process():
        try:
            lock = RunLock.acquire(run_dir, delegated_by=delegated_by)
        except RunDirLocked as exc:
            refused = exc
    reason = D.broadcast_object(str(refused) if refused is not None else None)
    if reason is not None:
        raise refused if refused is not None else RunDirLocked(reason)
    return lock


def read_history(path: Path, keep_upto: int) -> list[dict[str, Any]]:
    """The records of steps 1..keep_upto of a metrics file, each step once (the last line written for a
    step wins), in step order; unreadable lines (a half-written last line of a killed run) are dropped."""
    if not path.exists():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if 1 <= step <= keep_upto:
            by_step[step] = record
    return [by_step[s] for s in sorted(by_step)]


class RunDir:
    def __init__(self, path: str | os.PathLike[str], *, is_main: bool = True) -> None:
        self.path = Path(path)
        self.is_main = is_main
        self._metrics_f = None
        self._tb = None
        self._failed = False  # a write failed: the writers' close may fail the same way
        self.opened = False  # True once open() began: the directory may hold this run's files from then on

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def events_path(self) -> Path:
        return self.path / EVENTS_DIR

    def open(self, config_yaml: str, *, resume_step: int | None = None, tensorboard: bool = True) -> RunDir:
        """Create the directory, write the resolved config, cut the history back to ``resume_step`` (0 or
        None: a fresh start) and open the metrics writers."""
        self.opened = True
        if not self.is_main:
            return self
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(exist_ok=True)
        write_atomic(self.path / CONFIG_FILE, config_yaml)
        kept = self._truncate_metrics(resume_step or 0)
        self._metrics_f = self.metrics_path.open("a", encoding="utf-8")
        if tensorboard:
            self._tb = self._rebuild_events(kept)
        return self

    def _truncate_metrics(self, keep_upto: int) -> list[dict[str, Any]]:
        """Keep exactly the lines of steps <= ``keep_upto``, rewritten atomically; returns their records."""
        kept = read_history(self.metrics_path, keep_upto)
        text = "".join(json.dumps(r) + "\n" for r in kept)
        current = self.metrics_path.read_text(encoding="utf-8", errors="replace") if self.metrics_path.exists() else None
        if current is not None and current != text:
            write_atomic(self.metrics_path, text)
        return kept

    def _rebuild_events(self, kept: list[dict[str, Any]]) -> Any:
        """A fresh TensorBoard event file holding exactly ``kept``: the events are a view of metrics.jsonl,
        rebuilt from it on every open (a killed run may have left events for steps that are now dropped,
        or lost unflushed ones). One event per step: thousands of steps take a fraction of a second."""
        writer = _EventWriter.open(self.events_path)
        if writer is not None:
            for record in kept:
                writer.add(record)
            writer.flush()
        return writer

    def log(self, metrics: dict[str, Any]) -> None:
        """One line of ``metrics.jsonl`` (flushed) and one TensorBoard event. A failed write raises its OSError
        with the file it was writing (a failed ``write`` names none), for the one line the user gets."""
        if not self.is_main or self._metrics_f is None:
            return
        record = {k: _jsonable(v) for k, v in metrics.items()}
        with _naming(self, self.metrics_path):
            self._metrics_f.write(json.dumps(record, sort_keys=False) + "\n")
            self._metrics_f.flush()
        if self._tb is not None:
            with _naming(self, self.events_path):
                self._tb.add(metrics)
                self._tb.flush()

    def close(self) -> None:
        """Close the writers; after a failed write (the run is ending on it) their own errors are not news."""
        for name in ("_metrics_f", "_tb"):
            writer = getattr(self, name)
            setattr(self, name, None)
            if writer is not None:
                with contextlib.suppress(*((OSError,) if self._failed else ())):
                    writer.close()


@contextlib.contextmanager
def _naming(run_dir: RunDir, path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        run_dir._failed = True
        if exc.filename is None:
            exc.filename = str(path)
        raise


class _EventWriter:
    """TensorBoard scalars, one event per step (tag = metric name), in one event file written synchronously with
    tensorboard's record format (``RecordWriter``; what torch's SummaryWriter writes underneath). Synchronous: a
    failed write (a full disk) is raised here, in the loop, not printed as a traceback by a writer thread. None
    when tensorboard is not installed."""

    def __init__(self, file: Any, records: Any, event_cls: Any, summary_cls: Any) -> None:
        self._file, self._records, self._event, self._summary = file, records, event_cls, summary_cls

    @classmethod
    def open(cls, path: Path) -> _EventWriter | None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.record_writer import RecordWriter
        except ImportError:  # tensorboard is an optional extra
            return None
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        # TensorBoard reads files named *tfevents*; the name's parts are its writers' convention
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0"
        f = open(path / name, "wb")  # noqa: SIM115 - the writer owns it until close()
        writer = cls(f, RecordWriter(f), Event, Summary)
        writer._write(Event(wall_time=time.time(), file_version="brain.Event:2"))  # the file's first record
        return writer

    def add(self, metrics: dict[str, Any]) -> None:
        values = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        self._write(self._event(wall_time=time.time(), step=int(metrics["step"]), summary=self._summary(value=values)))

    def _write(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
