"""Time-bounded reward calls in worker processes.

Design choice: a reward that can hang (a symbolic comparison blowing up in sympy) runs in a small,
persistent pool of worker processes. Each call is bounded twice: inside the worker by a SIGALRM
timer (workers run tasks on their main thread, where signals work — math-verify's own signal
timeouts do not work in a trainer's non-main threads), and from the parent by a batch deadline
that, when passed, terminates the whole pool (a call stuck in C code ignores signals) and rebuilds
it on the next batch. Neither case raises: the caller gets a status per call.

Workers are forked: they inherit the parent's imported modules (no second import of torch or
transformers), cost milliseconds to start, and are created only on the first bounded call, so
tasks that score inline never pay for them.
"""

from __future__ import annotations

import atexit
import math
import multiprocessing
import multiprocessing.pool
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

# statuses of one call
OK, ERROR, TIMEOUT = "ok", "error", "timeout"


class _Deadline(BaseException):
    """Raised by the worker's alarm. A BaseException, so the reward's own ``except Exception`` (math-verify
    has several) cannot swallow it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Deadline


def _init_worker() -> None:
    # Ctrl-C is the parent's business: it terminates the pool; workers must not print tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, _on_alarm)
    import logging

    # We bound time ourselves, so math-verify's "timeout is disabled" warning is noise here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _call_bounded(fn: Callable[..., float], args: tuple, timeout_s: float) -> tuple[str, float | str]:
    """Runs in a worker: ``fn(*args)`` under an interval timer; returns (status, score or reason)."""
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return OK, float(fn(*args))
    except _Deadline:
        return TIMEOUT, f"took longer than {timeout_s} s"
    except Exception as exc:
        return ERROR, f"{type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


class BoundedPool:
    """A lazily started pool of forked workers running reward calls under a time bound."""

    def __init__(self, processes: int | None = None) -> None:
        self.processes = processes or max(1, min(4, os.cpu_count() or 1))
        self._pool: multiprocessing.pool.Pool | None = None
        self._lock = threading.Lock()
        self.restarts = 0  # pools terminated after a missed batch deadline

    def _get(self) -> multiprocessing.pool.Pool:
        if self._pool is None:
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            ctx = multiprocessing.get_context(method)
            self._pool = ctx.Pool(self.processes, initializer=_init_worker)
        return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool.join()
                self._pool = None

    def map(self, fn: Callable[..., float], calls: Sequence[tuple], timeout_s: float) -> list[tuple[str, Any]]:
        """``fn(*args)`` for each ``args`` in ``calls``; each result is (status, score | reason)."""
        if not calls:
            return []
        with self._lock:
            pool = self._get()
            pending = [pool.apply_async(_call_bounded, (fn, args, timeout_s)) for args in calls]
            # Each worker handles its calls one after the other; allow every wave its full bound plus slack
            # for process scheduling before declaring the pool stuck.
            waves = math.ceil(len(calls) / self.processes)
            deadline = time.monotonic() + timeout_s * (waves + 1) + 2.0
            results: list[tuple[str, Any]] = []
            stuck = False
            for job in pending:
                try:
                    results.append(job.get(timeout=max(0.0, deadline - time.monotonic())))
                except multiprocessing.TimeoutError:
                    stuck = True
                    results.append((TIMEOUT, "worker did not answer before the batch deadline"))
                except Exception as exc:  # unpicklable result or a worker that died
                    results.append((ERROR, f"{type(exc).__name__}: {exc}"))
            if stuck:
                self._pool.terminate()
                self._pool.join()
                self._pool = None
                self.restarts += 1
            return results


_shared: BoundedPool | None = None


def shared_pool() -> BoundedPool:
    """The process-wide pool (closed at exit)."""
    global _shared
    if _shared is None:
        _shared = BoundedPool()
        atexit.register(_shared.close)
    return _shared
