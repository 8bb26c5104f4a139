"""One process of a run, around the trainer: OpenMP's policy, determinism, and how the process ends.

Importing this module loads no torch: :func:`apply_openmp_policy` must run before torch does (libgomp reads
its environment once, when torch loads it).

- Same command, same numbers on a loaded CPU: with OpenMP's dynamic teams (``OMP_DYNAMIC=TRUE``) libgomp
  sizes each parallel region by the load average, and torch's reductions split their work by team size, so
  results would follow the machine's load. FALSE is libgomp's default; it is forced for this process and its
  torchrun workers.
- Speed, not numbers: OpenMP threads that spin while waiting (libgomp's default) lose their time slices to
  each other when other processes share the cores; sleeping waiters measured ~10-30x faster per step on a
  loaded 2-core machine, but ~2x slower on an idle one. So: passive only when other processes keep more than
  half the cores busy as the run starts, sampled over a moment (the 1-minute load average still counts the work
  that just ended, the previous run's included). The launcher decides for its workers (they would see each
  other starting). The user's own ``OMP_WAIT_POLICY`` wins.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from polyrl.core.plugins.backend import Backend

OMP_DECIDED_ENV = "POLYRL_OMP_WAIT_DECIDED"
BUSY_SAMPLE_S = 0.2


def busy_cores(sample_s: float = BUSY_SAMPLE_S) -> float | None:
    """How many cores other processes keep busy now (this one sleeps while sampling): /proc/stat over
    ``sample_s``; the 1-minute load average where there is no /proc (None where neither exists)."""
    def totals() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle  # user..steal (guest time is already in user)

    first = totals()
    if first is None:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    time.sleep(sample_s)
    second = totals()
    total, idle = second[0] - first[0], second[1] - first[1]  # type: ignore[index]
    return (os.cpu_count() or 1) * (1.0 - idle / total) if total > 0 else 0.0


def apply_openmp_policy(*, choose_wait: bool = True, sample: Callable[[], float | None] = busy_cores) -> None:
    """``OMP_DYNAMIC=FALSE`` always; the wait policy (see the module docstring) when ``choose_wait`` (a dry run
    computes no tensors and skips the sample). A no-op for the wait policy when torch is already loaded, the
    user set it, or this worker's launcher decided."""
    os.environ["OMP_DYNAMIC"] = "FALSE"
    if not choose_wait or "OMP_WAIT_POLICY" in os.environ or os.environ.get(OMP_DECIDED_ENV) or "torch" in sys.modules:
        return
    os.environ[OMP_DECIDED_ENV] = "1"
    busy = sample()
    if busy is not None and busy > 0.5 * (os.cpu_count() or 1):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def pin_determinism(backend: Backend) -> Callable[[], None]:
    """Same command, same metrics on the reference (CPU) backend, even on a loaded machine: deterministic
    algorithms (torch's CPU ``index_put_(accumulate=True)`` otherwise adds floats with racing atomics across
    threads, e.g. in the backward of the MoE expert-bias gather). Returns a function that restores the previous
    setting (``polyrl run`` may be called in-process, e.g. by tests)."""
    import torch

    if not backend.is_reference:
        return lambda: None
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    return lambda: torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def exit_if_a_peer_is_gone(wait_s: float = 1.0) -> None:
    """After an unexpected error: if a watched peer has ended, say so in one line and end this process (a
    collective broken by a dead peer is not this rank's fault). A collective can fail a moment before the
    dead peer's process is reaped: look for ``wait_s`` (distributed runs only)."""
    from polyrl.core import distributed as D
    from polyrl.core.distributed import launch as L

    deadline = time.monotonic() + (wait_s if D.is_distributed() else 0.0)
    while True:
        gone = L.peer_gone()
        if gone is not None:
            L.stop_for_peer(D.get_rank(), *gone)
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def exit_if_a_peer_ended_first() -> None:
    """Stopping on a signal: if a watched peer ended before it came (torchrun's agent SIGTERMs the survivors of
    a failed worker), the stop is that peer's failure: say so in one line and end this process."""
    from polyrl.core import distributed as D
    from polyrl.core.distributed import launch as L

    first = L.peer_ended_first()
    if first is not None:
        L.stop_for_peer(D.get_rank(), *first)


def end_process(rc: int, *, alone: bool = False) -> int:
    """Leave the process group the way the outcome allows; returns ``rc``.

    Finished (0), aborted (1) or refused (2): every rank's work is done (a barrier), every rank stops watching
    its peers, and only after a second barrier may one leave: then a peer that leaves is no failure, and the
    group is destroyed cleanly. A stopped torchrun worker (128+N) exits at once without the
    interpreter's teardown, which would destroy a process group whose peers are gone (C++ threads still
    joinable: "terminate called without an active exception", SIGABRT); its files are closed by then. A torchrun
    worker of a several-process run that ended cleanly leaves the same way after the group is destroyed
    (``leave_now``). ``alone``:
    an outcome this rank may have met alone (a fault of its machine): the others are not at a barrier, so it
    leaves like a stopped worker; their peer watch ends them."""
    from polyrl.core import distributed as D
    from polyrl.core.distributed import launch as L

    several = D.is_distributed()
    if rc in (0, 1, 2) and not alone:
        D.barrier()  # every rank's work is done
        L.unwatch_peers()
        D.barrier()  # every rank has stopped watching: only now may one leave (a peer out of the first
        # barrier and gone before this rank's main thread ran again was judged a mid-run failure)
        D.shutdown_distributed()
        if several and D.under_torchrun():
            leave_now(rc)
    elif (rc > 128 or alone) and D.under_torchrun():
        leave_now(rc)
    return rc


def leave_now(rc: int) -> None:
    """Exit without the interpreter's teardown (torchrun workers only; the trainer has closed their files, and
    the streams and logging are flushed here). After a clean ``destroy_process_group`` the gloo backend may
    still hold work objects (DTensor and FSDP collectives) that are destroyed during finalization, when the
    interpreter is being torn down; a clean two-process run on CPU then ended, rarely, in SIGABRT ("terminate
    called without an active exception") and torchrun reported the run failed."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def says_the_stop_line() -> bool:
    """Who prints "stopped by ...": the only process, or rank 0 of a torchrun started by hand; under the
    `polyrl run --nproc` launcher the launcher does (it outlives every worker)."""
    from polyrl.core.distributed import launch as L

    return os.environ.get("RANK", "0") == "0" and L.launcher_pid() is None
