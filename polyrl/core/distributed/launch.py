"""``polyrl run --nproc N``: re-run the same command as N local torchrun workers, and process lifetime.

Process tree of ``polyrl run --nproc N``::

    polyrl run --nproc N            the launcher: validates, locks the run directory, waits
      python -m polyrl.core.distributed.launch ...     torchrun's elastic agent (own session)
        python -m polyrl run ...    worker, rank 0      (torchrun puts each worker in its own session)
        python -m polyrl run ...    worker, rank 1 ...

The launcher does no training. It starts torchrun (``python -m torch.distributed.run --standalone
--nproc-per-node N -m polyrl <argv without --nproc>``) through this module's ``__main__``, which only adds a
lifeline to the agent before handing over to torchrun. Each worker sees torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, ...), which is how ``polyrl run`` knows it is a worker and must not launch again
(``polyrl.core.distributed.under_torchrun``). Multi-node runs skip this launcher and call torchrun with its
own rendezvous directly (docs/distributed.md).

Lifetime rules, enforced here:

- Workers die with their launcher. Every process below the launcher asks the kernel for SIGKILL when its
  parent dies (``prctl(PR_SET_PDEATHSIG)``, Linux) and runs a watchdog thread that kills the process when
  its parent, or the launcher named in ``POLYRL_LAUNCHER_PID``, is gone (every platform; it also covers
  the window before the prctl). torchrun starts each worker in a session of its own, so a signal to the
  launcher's process group never reaches the workers by itself: the chain launcher → agent → workers of
  parent-death signals is what ends them.
- SIGINT / SIGTERM / SIGHUP to the launcher are forwarded once to the agent (which is in its own session,
  so a terminal's Ctrl-C reaches the workers exactly once); torchrun sends the same signal to every worker
  and waits for them, SIGKILL after its shutdown timeout. A worker stops where it is (see
  ``install_stop_handlers``): a checkpoint being written is abandoned, never half-published.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from polyrl.core.errors import BadInputError

# Set by the launcher in its children: the pid of the `polyrl run --nproc` process the workers belong to.
LAUNCHER_PID_ENV = "POLYRL_LAUNCHER_PID"
AGENT_PID_ENV = "POLYRL_AGENT_PID"  # set by the agent for its workers: their expected parent
# Test-only: skip prctl(PR_SET_PDEATHSIG) so that the watchdog alone has to end orphaned processes.
TEST_NO_PDEATHSIG_ENV = "POLYRL_TEST_NO_PDEATHSIG"
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N`` (the workers must not see it)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        out.append(arg)
    return out


def torchrun_args(argv: Sequence[str], nproc: int, *, master_port: int | None = None) -> list[str]:
    """torchrun's own arguments for ``nproc`` local workers running ``polyrl <argv>``.

    ``--standalone`` lets torchrun pick a free port and run its own rendezvous on localhost; a fixed
    ``master_port`` uses the static rendezvous on that port instead.
    """
    if nproc < 1:
        raise BadInputError(f"--nproc must be >= 1, got {nproc}")
    args: list[str] = []
    if master_port is None:
        args.append("--standalone")
    else:
        args += ["--master-addr", "127.0.0.1", "--master-port", str(master_port), "--nnodes", "1"]
    return [*args, "--nproc-per-node", str(nproc), "-m", "polyrl", *strip_nproc(argv)]


def torchrun_command(argv: Sequence[str], nproc: int, *, master_port: int | None = None) -> list[str]:
    """The plain torchrun command line equivalent to ``polyrl <argv> --nproc N`` (what a user would type)."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(argv, nproc, master_port=master_port)]


def agent_command(argv: Sequence[str], nproc: int, *, master_port: int | None = None) -> list[str]:
    """The command the launcher starts: torchrun behind this module's lifeline (see ``_agent_main``)."""
    return [sys.executable, "-m", "polyrl.core.distributed.launch", *torchrun_args(argv, nproc, master_port=master_port)]


def launch_torchrun(
    argv: Sequence[str], nproc: int, *, env: Mapping[str, str] | None = None, master_port: int | None = None
) -> int:
    """Run ``polyrl <argv>`` as ``nproc`` torchrun workers; block until they end; return the exit code.

    The exit code is the first failing worker's (2 for bad input, 128+N for signal N), 0 when all succeed.
    One thread per worker for the CPU math libraries unless the user chose (``OMP_NUM_THREADS``): N workers
    with a thread per core each would oversubscribe the machine.
    """
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    child_env[LAUNCHER_PID_ENV] = str(os.getpid())
    # Workers must import this same polyrl even when it is not installed (run from a checkout).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, child_env.get("PYTHONPATH", "")) if p)
    cmd = agent_command(argv, nproc, master_port=master_port)
    agent: subprocess.Popen | None = None
    early: list[int] = []  # signals that came before the agent existed

    def forward(signum: int, frame: object) -> None:
        if agent is None:
            early.append(signum)
        elif agent.poll() is None:
            agent.send_signal(signum)

    previous = _set_handlers(forward)  # before the start: no signal may find the launcher unprepared
    try:
        # Own session: a terminal's Ctrl-C reaches the launcher only, which forwards it once.
        agent = subprocess.Popen(cmd, env=child_env, start_new_session=True)
        for signum in early[:1]:
            agent.send_signal(signum)
        code = agent.wait()
    finally:
        _restore_handlers(previous)
        if agent is not None and agent.poll() is None:  # the launcher itself failed: take the run down with it
            agent.kill()
            agent.wait()
    return 128 - code if code < 0 else code


def _set_handlers(handler: Callable[[int, object], None]) -> dict[int, object]:
    """``handler`` for the stop signals, except those ignored on purpose (``nohup`` ignores SIGHUP)."""
    previous = {}
    for name in STOP_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, handler)
    return previous


def _restore_handlers(previous: Mapping[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]


# --- lifeline: die with the parent -------------------------------------------------------------------
def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux ``PR_SET_PDEATHSIG``).

    Returns False where unavailable (other systems, or disabled for a test): the watchdog remains.
    """
    if not sys.platform.startswith("linux") or os.environ.get(TEST_NO_PDEATHSIG_ENV) == "1":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class _Watchdog(threading.Thread):
    """Kills this process (SIGKILL) when its parent changes or a watched process is gone.

    Uses pidfds where available (woken the moment a watched process exits), else polls every ``poll_s``.
    A daemon thread: it never keeps the process alive.
    """

    def __init__(self, parent: int, watched: Sequence[int], poll_s: float) -> None:
        super().__init__(name="polyrl-lifeline", daemon=True)
        self.parent, self.watched, self.poll_s = parent, [p for p in watched if p > 1], poll_s

    def _gone(self) -> bool:
        return os.getppid() != self.parent or any(not _alive(p) for p in self.watched)

    def run(self) -> None:
        fds = []
        if hasattr(os, "pidfd_open"):
            for pid in {self.parent, *self.watched}:
                # already gone (caught by _gone) or not permitted: polling covers it
                with contextlib.suppress(OSError):
                    fds.append(os.pidfd_open(pid))
        import select

        poller = select.poll() if fds and hasattr(select, "poll") else None
        for fd in fds:
            poller.register(fd, select.POLLIN)  # type: ignore[union-attr]
        while True:
            if self._gone():
                _kill_self()
            if poller is not None:
                poller.poll(int(self.poll_s * 1000))
            else:
                time.sleep(self.poll_s)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, i.e. exited but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no /proc: kill(pid, 0) is all we can know


_lifeline: _Watchdog | None = None


def _env_pid(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def launcher_pid() -> int | None:
    """The pid of the `polyrl run --nproc` launcher this process was started by, if any."""
    return _env_pid(LAUNCHER_PID_ENV)


def worker_pids(launcher: int) -> dict[int, int]:
    """``{RANK: pid}`` of the torchrun workers started by the `polyrl run --nproc` launcher ``launcher``,
    read from each process's environment in /proc (Linux; empty elsewhere). For drills and tools that
    must signal one particular rank."""
    from pathlib import Path

    found: dict[int, int] = {}
    procfs = Path("/proc")
    if not procfs.is_dir():
        return found
    for proc in procfs.iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in (proc / "environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if env.get(LAUNCHER_PID_ENV) == str(launcher) and "RANK" in env and "LOCAL_RANK" in env:
            found[int(env["RANK"])] = int(proc.name)
    return found


def die_with_parent(*, expected_parent: int | None = None, watch: Sequence[int | None] = (),
                    poll_s: float = 1.0) -> None:
    """Make this process end (SIGKILL) when its parent ends, or any process in ``watch`` ends. Idempotent.
    Call it first thing in a torchrun agent or worker.

    ``expected_parent``: the pid the parent should have; a different one means the real parent died before
    the kernel's parent-death signal was armed (the process was re-parented), and the process ends at once.
    """
    global _lifeline
    if _lifeline is not None:
        return
    parent = os.getppid()
    set_parent_death_signal(signal.SIGKILL)
    watched = [p for p in watch if p is not None and p > 1]
    if (expected_parent is not None and os.getppid() != expected_parent) or any(not _alive(p) for p in watched):
        _kill_self()
    _lifeline = _Watchdog(parent, watched, poll_s)
    _lifeline.start()


def worker_lifeline() -> None:
    """In a torchrun worker: die with the agent (the parent) and with the `polyrl run --nproc` launcher when
    there is one. Under a torchrun started by hand only the agent is watched."""
    die_with_parent(expected_parent=_env_pid(AGENT_PID_ENV), watch=[_env_pid(LAUNCHER_PID_ENV)])


def check_lifeline() -> None:
    """Before writing into the run directory: end now if the parent or launcher is gone (closes the
    window between a launcher's death and the watchdog's next look)."""
    if _lifeline is not None and _lifeline._gone():
        _kill_self()


# --- peers: a worker that ends takes the run down at once ----------------------------------------------
class _PeerWatch(threading.Thread):
    """Ends this worker (one line on stderr, exit 1) the moment a peer worker on this host ends.

    Without it a rank whose peer died waits inside a collective: over gloo until the broken connection
    surfaces as a traceback, over NCCL until torchrun's agent kills it (its SIGTERM cannot run a Python
    handler while the main thread waits in C++) or the NCCL timeout. The collectives release the GIL while
    they wait, so this thread runs. Disarmed once every rank has finished its work (``unwatch_peers``),
    so a peer that leaves first at the end of a run is no failure.
    """

    # A peer that ends because the run is being stopped (torchrun's agent sends SIGTERM to every worker
    # when it is signalled; a scheduler signals every process) is no failure of that peer: this rank got the
    # same signal and stops on its own path ("stopped by ..."). But the agent also SIGTERMs the survivors
    # when a worker *fails*, a moment after (its monitor interval, 0.1 s): then the peer's end is the cause.
    # Which came first is read from one poll over the peers' pidfds and the interpreter's C-level wakeup fd
    # (written the moment a signal arrives, even while the main thread waits in a collective): the kernel
    # fills poll's ready list when the thread wakes, so the answer does not depend on when this thread next
    # gets the GIL. A peer whose end is seen with no stop signal in that list ended first. A stopped peer
    # needs tens of milliseconds to exit after its signal, which this rank got at the same moment.
    GRACE_S = 0.25  # no pidfd (not Linux): after a peer is found gone, how long a stop signal may still come
    STOPPING_S = 3.0  # signalled, and a peer gone: the main thread may wait in a collective that can never
    # finish (NCCL would wait for its timeout); past this the watch ends the process with the stop's code

    def __init__(self, rank: int, peers: Mapping[int, int]) -> None:
        super().__init__(name="polyrl-peers", daemon=True)
        self.rank, self.peers = rank, dict(peers)
        self.armed = threading.Event()
        self.armed.set()
        self.signalled: int | None = None  # the stop signal that reached this process
        self.first: tuple[int, int] | None = None  # (rank, pid) of a peer that ended before any stop signal
        self.decided = threading.Event()  # set once a peer's end has been judged (``first`` says how)
        self._sig_r, self._sig_w, self._prev_wakeup = -1, -1, None
        if threading.current_thread() is threading.main_thread():
            self._sig_r, self._sig_w = os.pipe()
            os.set_blocking(self._sig_r, False)
            os.set_blocking(self._sig_w, False)
            self._prev_wakeup = signal.set_wakeup_fd(self._sig_w, warn_on_full_buffer=False)

    def gone(self) -> tuple[int, int] | None:
        return next(((r, p) for r, p in sorted(self.peers.items()) if not _alive(p)), None)

    def _drain_signals(self) -> bool:
        """True once a stop signal has reached this process (read from the wakeup pipe)."""
        if self._sig_r >= 0 and self.signalled is None:
            with contextlib.suppress(BlockingIOError, OSError):
                while data := os.read(self._sig_r, 64):
                    stops = [b for b in data if b in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
                    if stops and self.signalled is None:
                        self.signalled = stops[0]
        return self.signalled is not None

    def close(self) -> None:
        """Main thread: give the wakeup fd back (the pipe is left to the process's end; the thread may
        still be polling it)."""
        if self._prev_wakeup is not None:
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._prev_wakeup)
            self._prev_wakeup = None

    def _wait(self, poller: object | None, pidfds: Mapping[int, tuple[int, int]]) -> tuple[set[int] | None, bool]:
        """Sleep until a peer ends, a signal comes or 0.2 s pass. Returns the fds the kernel found ready
        (None without a poller) and whether a stop signal was among them."""
        if poller is None:
            time.sleep(0.2)
            return None, False
        ready = {fd for fd, _ in poller.poll(200)}  # type: ignore[attr-defined]
        return ready, self._sig_r in ready

    def _judge(self, ready: set[int] | None, signal_seen: bool,
               pidfds: Mapping[int, tuple[int, int]]) -> tuple[int, int] | None:
        """The peer that ended first, or None (no peer gone, or this rank is being stopped)."""
        ended = sorted(pidfds[fd] for fd in (ready or ()) if fd in pidfds)
        if ended and not signal_seen:
            return ended[0]  # its end came before any stop signal (one kernel snapshot)
        if ended or self._drain_signals():
            return None  # a stop signal came with or before the peer's end: this rank is being stopped
        watched = set(pidfds.values())  # the others' ends come through poll
        found = next(((r, p) for r, p in sorted(self.peers.items()) if (r, p) not in watched and not _alive(p)),
                     None)  # a peer without a pidfd
        if found is None:
            return None
        deadline = time.monotonic() + self.GRACE_S
        while time.monotonic() < deadline and not self._drain_signals():
            time.sleep(0.02)
        return None if self._drain_signals() else found

    def run(self) -> None:
        import select

        pidfds: dict[int, tuple[int, int]] = {}
        if hasattr(os, "pidfd_open"):
            for rank, pid in self.peers.items():
                with contextlib.suppress(OSError):
                    pidfds[os.pidfd_open(pid)] = (rank, pid)
        fds = [*pidfds, *([self._sig_r] if self._sig_r >= 0 else [])]
        poller = select.poll() if fds and hasattr(select, "poll") else None
        for fd in fds:
            poller.register(fd, select.POLLIN)  # type: ignore[union-attr]
        while self.armed.is_set():
            ready, signal_seen = self._wait(poller, pidfds)
            if not self.armed.is_set():
                return
            first = self._judge(ready, signal_seen, pidfds)
            if first is not None:
                self.first = first
                self.decided.set()
                stop_for_peer(self.rank, *first)
            if self._drain_signals():
                break
        self.decided.set()  # stopping on a signal: a peer's end from here on is part of the same stop
        while self.armed.is_set():  # the main thread says and does the rest
            if self.gone() is not None:
                deadline = time.monotonic() + self.STOPPING_S
                while self.armed.is_set() and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self.armed.is_set():  # still here: stuck in a collective with the dead peer
                    sys.stderr.flush()
                    sys.stdout.flush()
                    os._exit(128 + (self.signalled or signal.SIGTERM))
            time.sleep(0.2)


PEER_GONE_EXIT = 1
_peer_watch: _PeerWatch | None = None
_peer_stop = threading.Lock()


def stop_for_peer(rank: int, peer_rank: int, pid: int) -> None:
    """Say once why this rank stops (the watch thread and a broken collective in the main thread can both
    get here: the lock makes it one whole line), then end the process at once."""
    _peer_stop.acquire()  # never released: the second caller waits here until the first has ended the process
    sys.stderr.write(f"polyrl run: [rank {rank}] rank {peer_rank} (pid {pid}) ended in the middle of the run; "
                     "this rank stops too\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(PEER_GONE_EXIT)


def watch_peers(rank: int, peers: Mapping[int, int]) -> None:
    """Watch the other workers of this host (``{rank: pid}``); see ``_PeerWatch``. Idempotent."""
    global _peer_watch
    if _peer_watch is not None or not peers:
        return
    _peer_watch = _PeerWatch(rank, peers)
    _peer_watch.start()


def unwatch_peers() -> None:
    """Every rank is done (call after a barrier): peers may now leave in any order."""
    global _peer_watch
    if _peer_watch is not None:
        _peer_watch.armed.clear()
        _peer_watch.close()
        _peer_watch = None


def peer_gone() -> tuple[int, int] | None:
    """``(rank, pid)`` of a watched peer that has ended, or None (also when nothing is watched, and when
    this rank itself is being stopped by a signal that came before the peer's end: then the peer's end is
    part of the same stop)."""
    if _peer_watch is None:
        return None
    if _peer_watch.first is not None:
        return _peer_watch.first
    if _peer_watch._drain_signals():
        return None
    return _peer_watch.gone()


def peer_ended_first(wait_s: float = 1.0) -> tuple[int, int] | None:
    """Main thread, stopping on a signal: ``(rank, pid)`` of a peer that ended *before* the signal came (the
    agent SIGTERMs the survivors of a failed worker; that stop is the peer's failure), else None. When a peer
    is gone the watch's verdict is waited for, ``wait_s`` at most: it may not have had the GIL yet."""
    watch = _peer_watch
    if watch is None:
        return None
    if watch.first is None and watch.gone() is not None:
        watch.decided.wait(wait_s)
    return watch.first


# --- stopping on a signal ------------------------------------------------------------------------------
_stop_signal: int | None = None


def install_stop_handlers() -> Callable[[], None]:
    """SIGINT, SIGTERM and SIGHUP stop the run where it is: the first one raises ``KeyboardInterrupt`` in
    the main thread (so ``finally`` blocks close the metrics file); later ones are ignored while stopping
    (torchrun and a scheduler may both deliver one). Main thread only. Returns a function that puts the
    previous handlers back (``polyrl run`` may be called in-process, e.g. by tests)."""
    global _stop_signal
    _stop_signal = None
    owner = os.getpid()

    def handler(signum: int, frame: object) -> None:
        global _stop_signal
        if os.getpid() != owner:  # a forked child (e.g. a reward worker) that inherited the handler: default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if _stop_signal is not None:
            return
        _stop_signal = signum
        raise KeyboardInterrupt

    previous = _set_handlers(handler)
    return lambda: _restore_handlers(previous)


def stop_signal() -> int | None:
    """The signal that is stopping this process, or None."""
    return _stop_signal


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# --- the agent: torchrun behind the lifeline ---------------------------------------------------------------
def _agent_main(args: Sequence[str]) -> int:
    """torchrun's elastic agent, with a lifeline to the launcher and plain exit codes.

    Exit code: the first failing worker's code (so bad input in a worker still exits 2), 128+N when a
    worker died of signal N or the agent itself was signalled.
    """
    die_with_parent(expected_parent=_env_pid(LAUNCHER_PID_ENV))  # the parent *is* the launcher
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the workers' expected parent (torchrun passes os.environ on)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(list(args)))
    except ChildFailedError as exc:
        # The first failure; timestamps are whole seconds, so among equals prefer one that is not a rank
        # stopping because its peer had gone or because this agent SIGTERMed it after another failed (the cause,
        # not the consequence; seen under load: rank 0's 143 named instead of rank 1's SIGKILL).
        consequences = (PEER_GONE_EXIT, 128 + signal.SIGTERM, -signal.SIGTERM)
        rank, failure = min(exc.failures.items(),
                            key=lambda kv: (kv[1].timestamp, kv[1].exitcode in consequences, kv[0]))
        code = failure.exitcode
        if code != 2:  # bad input: the worker said it in one line already
            how = f"was killed by {failure.signal_name()}" if code < 0 else f"exited with code {code}"
            sys.stderr.write(f"polyrl run: rank {rank} (pid {failure.pid}) {how}; every rank has stopped\n")
            sys.stderr.flush()
        return 128 - code if code < 0 else (code or 1)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(_agent_main(sys.argv[1:]))
