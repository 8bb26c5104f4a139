"""Time-bounded reward calls in worker processes.

Design choice: a reward that can hang (a symbolic comparison blowing up in sympy) runs in a small,
persistent pool of worker processes. Each call is bounded twice: inside the worker by a SIGALRM
timer (workers run tasks on their main thread, where signals work — math-verify's own signal
timeouts do not work in a trainer's non-main threads), and from the parent by a batch deadline
that, when passed, terminates the whole pool (a call stuck in C code ignores signals) and rebuilds
it on the next batch. A worker that dies in a call (a segfaulting verifier, the OOM killer) is seen
at once: each call tells the parent which worker took it, and the parent watches the workers, so the
call is answered ``crashed`` (naming the signal) instead of waiting for the deadline; the pool is
rebuilt after that batch. No case raises: the caller gets a status per call.

Workers are forked: they inherit the parent's imported modules (no second import of torch or
transformers), cost milliseconds to start, and are created only on the first bounded call, so
tasks that score inline never pay for them.
"""

from __future__ import annotations

import atexit
import contextlib
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
OK, ERROR, TIMEOUT, CRASHED = "ok", "error", "timeout", "crashed"
POLL_S = 0.05  # how often the parent looks at its workers while it waits for answers

_started: Any = None  # in a worker: the queue on which it says which call it took (its pool's)


class _Deadline(BaseException):
    """Raised by the worker's alarm. A BaseException, so the reward's own ``except Exception`` (math-verify
    has several) cannot swallow it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Deadline


def _init_worker(started: Any = None) -> None:
    global _started
    _started = started
    # Ctrl-C is the parent's business: it terminates the pool; workers must not print tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The parent ends its workers with SIGTERM (Pool.terminate) and then waits for them: the trainer's stop
    # handlers, inherited through the fork, would only set a flag in a worker stuck in C code (or waiting on the
    # pool's task lock, which terminate holds), and that wait would never end.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGALRM, _on_alarm)
    import logging

    # We bound time ourselves, so math-verify's "timeout is disabled" warning is noise here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _call_bounded(fn: Callable[..., float], args: tuple, timeout_s: float, call: Any = None) -> tuple[str, float | str]:
    """Runs in a worker: ``fn(*args)`` under an interval timer; returns (status, score or reason). ``call``: its
    id, told to the parent with this worker's pid first (a worker that dies inside ``fn`` is then known)."""
    if call is not None and _started is not None:
        _started.put((call, os.getpid()))
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return OK, float(fn(*args))
    except _Deadline:
        return TIMEOUT, f"took longer than {timeout_s} s"
    except Exception as exc:
        return ERROR, f"{type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"reward worker killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"reward worker exited ({exitcode})"


class _WatchedPool(multiprocessing.pool.Pool):
    """A pool that keeps every worker it starts: the pool forgets a dead worker as it replaces it (within
    0.1 s), and its exit status (the signal that killed it) is what the parent reports."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.every_worker: dict[int | None, Any] = {}  # filled while super().__init__ starts the first workers
        super().__init__(*args, **kwargs)

    def Process(self, ctx: Any, *args: Any, **kwargs: Any) -> Any:
        proc = ctx.Process(*args, **kwargs)
        started = proc.start

        def start() -> None:
            started()
            self.every_worker[proc.pid] = proc

        proc.start = start
        return proc


REAP_AFTER_S = 2.0  # how long Pool.terminate's SIGTERM is given before the workers still there are SIGKILLed


def _reap(pool: _WatchedPool, done: threading.Event) -> None:
    """SIGKILL the workers that outlive ``Pool.terminate``'s SIGTERM by REAP_AFTER_S. Terminating, the pool holds
    its task queue's lock (so no worker can take a task) and its worker thread may still fork a replacement for a
    dead worker; seen in the suite under load: such a worker sat blocked on that lock and terminate's join waited
    for it forever. Whatever the interleaving, a worker still there after the SIGTERM is killed. Only workers the
    pool has not reaped yet are signalled (their pid is not reused)."""
    if done.wait(REAP_AFTER_S):
        return
    while not done.is_set():
        for proc in list(pool.every_worker.values()):
            popen = getattr(proc, "_popen", None)
            if popen is not None and popen.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        done.wait(0.5)


class BoundedPool:
    """A lazily started pool of forked workers running reward calls under a time bound."""

    def __init__(self, processes: int | None = None) -> None:
        self.processes = processes or max(1, min(4, os.cpu_count() or 1))
        self._pool: _WatchedPool | None = None
        self._started: Any = None  # the queue on which workers say which call they took
        self._lock = threading.Lock()
        self.restarts = 0  # pools terminated after a missed batch deadline or a dead worker
        self.crashes = 0  # calls whose worker died in them

    def _get(self) -> _WatchedPool:
        if self._pool is None:
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            ctx = multiprocessing.get_context(method)
            self._started = ctx.SimpleQueue()
            self._pool = _WatchedPool(self.processes, initializer=_init_worker, initargs=(self._started,), context=ctx)
        return self._pool

    def _drop(self) -> None:
        if self._pool is not None:
            pool = self._pool
            done = threading.Event()
            reaper = threading.Thread(target=_reap, args=(pool, done), name="polyrl-reward-reaper", daemon=True)
            reaper.start()
            try:
                pool.terminate()
                pool.join()
            finally:
                done.set()
                reaper.join()
            self._pool = None
        if self._started is not None:
            self._started.close()
            self._started = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    def map(self, fn: Callable[..., float], calls: Sequence[tuple], timeout_s: float) -> list[tuple[str, Any]]:
        """``fn(*args)`` for each ``args`` in ``calls``; each result is (status, score | reason)."""
        if not calls:
            return []
        with self._lock:
            pool = self._get()
            batch = os.urandom(8).hex()  # a late "started" note of an earlier batch is not one of these calls
            pending = [pool.apply_async(_call_bounded, (fn, args, timeout_s, (batch, i))) for i, args in enumerate(calls)]
            # Each worker handles its calls one after the other; allow every wave its full bound plus slack
            # for process scheduling before declaring the pool stuck.
            waves = math.ceil(len(calls) / self.processes)
            deadline = time.monotonic() + timeout_s * (waves + 1) + 2.0
            results: list[tuple[str, Any] | None] = [None] * len(calls)
            taken: dict[int, int] = {}  # call -> pid of the worker that took it
            # pid -> the last call that worker started: a worker runs its calls one after the other and sends a
            # call's result before it takes the next, so only its last call can have died with it (an earlier one's
            # result may still be on its way to the pool's result thread when the death is seen)
            last: dict[int, int] = {}
            stuck = crashed = False
            while True:
                for i, job in enumerate(pending):
                    if results[i] is None and job.ready():
                        results[i] = self._answer(job)
                open_calls = [i for i, r in enumerate(results) if r is None]
                if not open_calls:
                    break
                if time.monotonic() >= deadline:
                    stuck = True
                    for i in open_calls:
                        results[i] = (TIMEOUT, "worker did not answer before the batch deadline")
                    break
                while not self._started.empty():
                    (tag, i), pid = self._started.get()
                    if tag == batch:
                        taken[i] = pid
                        last[pid] = i
                for i in open_calls:
                    pid = taken.get(i, -1)
                    proc = pool.every_worker.get(pid)
                    if (proc is not None and proc.exitcode is not None and last.get(pid) == i
                            and not pending[i].ready()):
                        results[i] = (CRASHED, _death(proc.exitcode))
                        crashed = True
                        self.crashes += 1
                pending[open_calls[0]].wait(POLL_S)
            if stuck or crashed:  # a dead worker's call never completes: a fresh pool holds no trace of it
                self._drop()
                self.restarts += 1
            return results  # type: ignore[return-value]

    @staticmethod
    def _answer(job: Any) -> tuple[str, Any]:
        try:
            return job.get(timeout=0)
        except Exception as exc:  # unpicklable result
            return ERROR, f"{type(exc).__name__}: {exc}"


_shared: BoundedPool | None = None


def shared_pool() -> BoundedPool:
    """The process-wide pool (closed at exit)."""
    global _shared
    if _shared is None:
        _shared = BoundedPool()
        atexit.register(_shared.close)
    return _shared
