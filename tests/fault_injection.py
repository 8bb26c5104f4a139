"""Faults of the machine for tests: a small real file system when the suite may make one, else injected errors.

``small_fs(path, mib)`` mounts a tmpfs of that size at ``path`` when the suite runs as root and ``mount`` works
(a real full disk: the error comes from the kernel through every library layer); elsewhere it returns None and the
test injects ``OSError(ENOSPC)`` where the writer would meet it. ``POLYRL_TEST_INJECT_FAULTS=1`` forces the injected
variant (to run it where the tmpfs is available). The injections are monkeypatches inside the test process: no
product code carries a hook for them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MIB = 1024 * 1024


class SmallFS:
    """A tmpfs mounted at ``path``; ``resize`` stands for the user freeing space."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def resize(self, mib: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={mib}m", str(self.path)], check=True, capture_output=True)

    def fill(self, leave: int = 0) -> Path:
        """Take every free byte but ``leave`` (another process filling the disk); returns the filler file."""
        filler = self.path / "filler"
        with open(filler, "ab") as f, contextlib.suppress(OSError):
            while (free := _free(self.path)) > leave:
                f.write(b"\0" * min(free - leave, MIB))
                f.flush()
        return filler


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def can_mount() -> bool:
    return os.environ.get("POLYRL_TEST_INJECT_FAULTS") != "1" and hasattr(os, "geteuid") and os.geteuid() == 0


@contextlib.contextmanager
def small_fs(path: Path, mib: int) -> Iterator[SmallFS | None]:
    """A tmpfs of ``mib`` MiB at ``path`` (created), or None where the suite cannot mount one."""
    path.mkdir(parents=True, exist_ok=True)
    if not can_mount():
        yield None
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:  # root without the capability (a container): inject instead
        yield None
        return
    try:
        yield SmallFS(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[str | None]:
    """``path`` read-only for this process while inside: a read-only bind mount as root (EROFS), permissions
    otherwise (EACCES). None when neither works (root without mount): inject instead."""
    if can_mount():
        bind = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
        if bind.returncode == 0:
            if subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], capture_output=True).returncode == 0:
                try:
                    yield "EROFS"
                finally:
                    subprocess.run(["umount", "-l", str(path)], capture_output=True)
                return
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o555)
        try:
            yield "EACCES"
        finally:
            path.chmod(mode)
        return
    yield None


def no_space() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class FailsAt:
    """A file object whose ``call``-th ``write`` (counted from 1) fails with ENOSPC, as the kernel reports a full
    disk (no file name); the writes before it pass through."""

    def __init__(self, raw: Any, call: int) -> None:
        self._raw, self._left = raw, call

    def write(self, data: Any) -> int:
        self._left -= 1
        if self._left == 0:
            raise no_space()
        return self._raw.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)
