"""Faults of the machine in the middle of a command, as the one line the user reads.

A run or an export that meets a full or unwritable disk, device memory running out, a rollout engine that
raises, or reward workers failing batch after batch ends with exit 1 and one line: the cause, what to do, and
(for a run, added by the trainer) the step the same command resumes from. Never a traceback: the line is what
the user acts on. Bad input is not a fault (``BadInputError``, exit 2), nor is a stop signal (``RunStopped``);
anything this module does not recognise keeps its traceback (a bug should be seen as one).

How a fault is recognised:

- an ``OSError`` whose errno is a file-system fault (``FILE_SYSTEM_FAULTS``), on the exception itself, along its
  causes and contexts, or among the per-rank failures DCP wraps in a ``CheckpointException`` (DCP's writer turns
  a full disk into torch's zip-writer ``RuntimeError("... unexpected pos ...")`` whose context holds the
  ``OSError``); safetensors (the HF export) names the errno only in its message (``os error 28``);
- a write that failed without any errno while its file system was (nearly) full: torch's zip writer can report
  a short write that way (``NEARLY_FULL_BYTES``);
- :class:`Fault`, raised by polyrl itself: a rollout engine that raised, rewards that all failed too many batches
  in a row, a save refused before writing for lack of space, device memory (the trainer builds that line: it
  knows the phase and the recipe key).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
# A failed write without an errno (torch's zip writer: "unexpected pos") counts as a full disk when its file
# system has less than this left at the moment of the failure: a file system that full cannot take a checkpoint.
NEARLY_FULL_BYTES = 1 * MIB

# errno -> (what happened to PATH, what to do before rerunning)
FILE_SYSTEM_FAULTS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left on {path}", "free space"),
    errno.EDQUOT: ("disk quota exceeded on {path}", "free space or raise the quota"),
    errno.EACCES: ("permission denied on {path}", "make it writable"),
    errno.EPERM: ("operation not permitted on {path}", "make it writable"),
    errno.EROFS: ("{path} is on a read-only file system", "make it writable"),
    errno.EIO: ("input/output error on {path}", "check the disk (dmesg)"),
}
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class Fault(RuntimeError):
    """A fault of the machine polyrl met (not bad input, not a bug): ``cause`` (what happened), ``detail`` (the
    underlying error, or "") and ``todo`` (what to do before rerunning). ``line(doing)`` is the one line;
    ``doing`` ("at step 7", "while saving step 75") is where the command was."""

    def __init__(self, cause: str, todo: str, detail: str = "") -> None:
        super().__init__(f"{cause}{f' ({detail})' if detail else ''}; {todo}")
        self.cause, self.todo, self.detail = cause, todo, detail

    def line(self, doing: str = "") -> str:
        where = f" {doing}" if doing else ""
        return f"{self.cause}{where}{f' ({self.detail})' if self.detail else ''}; {self.todo}"


class NotEnoughSpace(Fault):
    """A write of ``what`` ("checkpoint step 75", "the export") found less free space than it needs: before
    writing (``before``: nothing was written) or when a write failed for lack of space (what it had written is
    removed). ``line`` ignores ``doing``: ``what`` already says it."""

    def __init__(self, path: str | os.PathLike[str], what: str, needed: int, free: int, *, before: bool) -> None:
        self.path, self.needed, self.free, self.before = Path(path), int(needed), int(free), before
        sizes = f"needs ~{_mib(needed)} MiB, {_mib(free)} MiB free"
        cause = (f"not enough space on {path} for {what} ({sizes}); nothing was written" if before
                 else f"no space left on {path} while writing {what} ({sizes})")
        super().__init__(cause, "free space")

    def line(self, doing: str = "") -> str:
        return f"{self.cause}; {self.todo}"


class EngineFailed(Fault):
    """The rollout engine raised while generating (not device memory: that is the trainer's own line)."""

    def __init__(self, engine: str, exc: BaseException) -> None:
        super().__init__(f"the rollout engine {engine} failed", "fix the cause shown", _brief(exc))
        self.engine = engine


class RewardsFailing(Fault):
    """Every reward of ``batches`` generation batches in a row failed (raised, timed out, or its worker died)."""

    def __init__(self, batches: int, key: str, last: str) -> None:
        super().__init__(f"every reward failed in {batches} generation batches in a row",
                         f"fix the reward function (or raise {key}, 0 never stops)", f"the last: {last}" if last else "")


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def _brief(exc: BaseException) -> str:
    """``Type: first line of the message`` (an error message can be pages long: vLLM's, CUDA's)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


# --- recognising a fault --------------------------------------------------------------------------------------
def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the exceptions DCP gathered per rank into a CheckpointException
    (``failures``: rank -> (exception, traceback summary)), each once."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]
        stack += [e.__context__, e.__cause__]


_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")  # Rust's io::Error, as safetensors reports it


def os_error_in(exc: BaseException | None) -> OSError | None:
    """The file-system ``OSError`` behind ``exc`` (errno in ``FILE_SYSTEM_FAULTS``), or None."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in FILE_SYSTEM_FAULTS:
            return e
        m = _OS_ERROR_IN_TEXT.search(str(e)) if not isinstance(e, OSError) else None
        if m and int(m.group(1)) in FILE_SYSTEM_FAULTS:
            return OSError(int(m.group(1)), os.strerror(int(m.group(1))))
    return None


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Free bytes for an unprivileged writer on the file system of ``path`` (or of its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def dir_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the files under ``path``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)


def expected_bytes(state: Mapping[str, Any], previous: str | os.PathLike[str] | None) -> int:
    """What a checkpoint of ``state`` (DCP state dicts) takes: the ``previous`` checkpoint's size (the same
    state, so the same size), or, before the first, the bytes of every tensor at its global size (DCP writes each
    once over all ranks; a DTensor's numel is global), whichever is larger."""
    import torch

    tensors = 0
    stack: list[Any] = [state]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            tensors += x.numel() * x.element_size()
        elif isinstance(x, Mapping):
            stack += list(x.values())
        elif isinstance(x, (list, tuple)):
            stack += list(x)
    return max(tensors, dir_bytes(previous) if previous is not None else 0)


def is_out_of_space(exc: BaseException, path: str | os.PathLike[str]) -> bool:
    """A write failed for lack of space: ENOSPC/EDQUOT behind ``exc``, or no errno at all while ``path``'s file
    system is (nearly) full (call it before removing what the failed write left)."""
    err = os_error_in(exc)
    if err is not None:
        return err.errno in _NO_SPACE
    with contextlib.suppress(OSError):
        return free_bytes(path) < NEARLY_FULL_BYTES
    return False


def os_fault(exc: BaseException, where: str | os.PathLike[str] | None = None) -> Fault | None:
    """The :class:`Fault` of a file-system error behind ``exc``, None when there is none. ``where``: the path
    being written, named when the OSError names none (a failed ``write`` has no file name)."""
    err = os_error_in(exc)
    if err is None:
        return None
    what, todo = FILE_SYSTEM_FAULTS[err.errno]
    path = err.filename if err.filename is not None else (where if where is not None else "the disk")
    return Fault(what.format(path=path), todo)


def fault_line(exc: BaseException, doing: str = "", where: str | os.PathLike[str] | None = None) -> str | None:
    """``cause doing (detail); what to do`` for a fault of the machine, None for anything else."""
    fault = exc if isinstance(exc, Fault) else os_fault(exc, where)
    return fault.line(doing) if fault is not None else None


# --- writing a directory that is published whole ---------------------------------------------------------
@contextlib.contextmanager
def writing_whole(out: str | os.PathLike[str], needed: int, what: str) -> Iterator[Path]:
    """Write a new directory ``out`` all or nothing: refuse before writing when its file system has less than
    ``needed`` bytes free (:class:`NotEnoughSpace`), and on a failure remove what was written (a half-written
    model directory must not look like an export), raising a :class:`Fault` for a fault of the machine."""
    out = Path(out)
    free = free_bytes(out)
    if free < needed:
        raise NotEnoughSpace(out, what, needed, free, before=True)
    created = not out.exists()
    try:
        yield out
    except Exception as exc:
        full = is_out_of_space(exc, out)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        elif out.is_dir():  # it was empty before (the caller refuses a non-empty one)
            for item in out.iterdir():
                shutil.rmtree(item, ignore_errors=True) if item.is_dir() else item.unlink(missing_ok=True)
        if full:
            raise NotEnoughSpace(out, what, needed, free_bytes(out), before=False) from exc
        fault = os_fault(exc, out)
        if fault is None:
            raise
        raise Fault(f"{fault.cause} while writing {what}", fault.todo) from exc
