"""The peer watch in isolation (in a child interpreter, since it ends its process): a peer that ends
mid-run ends this rank with one line, but not when this rank is itself being stopped by a signal (torchrun's
agent signals every worker at once; whichever stops first must not be reported as the failure)."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from polyrl.core.distributed import launch as L

    restore = L.install_stop_handlers()
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    L.watch_peers(0, {1: peer.pid})
    if sys.argv[1] in ("signalled", "stuck"):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
        except KeyboardInterrupt:
            pass
        assert L.stop_signal() == signal.SIGTERM
    time.sleep(0.3)  # the watch is polling
    if sys.argv[1] == "agent":  # torchrun's agent SIGTERMs the survivors of a failed worker a moment after
        from polyrl.core.distributed import process as P
        try:
            peer.kill()
            time.sleep(float(sys.argv[2]))
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt:  # what `polyrl run` does with a stop
            P.exit_if_a_peer_ended_first()
            print("stopped", flush=True)
            sys.exit(128 + signal.SIGTERM)
    peer.kill()
    peer.wait()
    time.sleep(1.5 if sys.argv[1] != "stuck" else 20)  # > the watch's poll interval and grace; "stuck": a
    # main thread that never gets back from a collective with the dead peer
    print("still running", L.peer_gone(), flush=True)
    L.unwatch_peers()
    restore()
""")


def _run(mode: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode, *args], capture_output=True, text=True, timeout=60)


def test_a_peer_that_ends_mid_run_ends_this_rank_with_one_line() -> None:
    res = _run("plain")
    assert res.returncode == 1, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("polyrl run: [rank 0] rank 1 (pid "), res.stderr
    assert lines[0].endswith("ended in the middle of the run; this rank stops too"), res.stderr
    assert "still running" not in res.stdout


@pytest.mark.parametrize("delay_s", ["0.005", "0.02", "0.1"])
def test_a_peer_that_fails_is_the_cause_though_the_agent_sigterms_this_rank_a_moment_after(delay_s: str) -> None:
    # The agent notices a failed worker within its monitor interval (0.1 s) and SIGTERMs the others: which came
    # first, the peer's end or the signal, decides the line (a fixed grace after the peer's end lost this race).
    res = _run("agent", delay_s)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].endswith("ended in the middle of the run; this rank stops too"), res.stderr
    assert "stopped" not in res.stdout


def test_a_rank_being_stopped_by_a_signal_does_not_report_its_peers_end_as_the_failure() -> None:
    res = _run("signalled")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ended in the middle" not in res.stderr, res.stderr
    assert res.stdout.strip() == "still running None", res.stdout


def test_a_signalled_rank_stuck_with_a_dead_peer_ends_with_the_stops_exit_code() -> None:
    t0 = time.monotonic()
    res = _run("stuck")
    assert res.returncode == 128 + signal.SIGTERM, res.stdout + res.stderr
    assert time.monotonic() - t0 < 15 and res.stderr == "" and "still running" not in res.stdout


FINISH = textwrap.dedent("""
    import os, sys, time
    import torch.distributed as dist
    from polyrl.core import distributed as D
    from polyrl.core.distributed import launch as L
    from polyrl.core.distributed import process as P

    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    L.watch_peers(rank, {1 - rank: pids[1 - rank]})
    if rank == 0:  # a main thread that is slow to get back from the final barrier (a loaded machine)
        real = D.barrier

        def slow_barrier():
            real()
            time.sleep(1.0)

        D.barrier = slow_barrier
    sys.exit(P.end_process(0))
""")


def test_a_peer_that_leaves_after_the_final_barrier_is_no_failure_however_late_this_rank_gets_back(tmp_path) -> None:
    # Both ranks finished; rank 1 is out of the final barrier and gone before rank 0's main thread runs again.
    # Its end must not be judged a mid-run failure (it was, rarely, on a loaded CI machine: a clean
    # two-process run exited 1 after "done").
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", FINISH, str(r), str(store)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    res = [p.communicate(timeout=60) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, res)):
        assert p.returncode == 0, f"rank {r}: rc {p.returncode}\n{out}{err}"
        assert "ended in the middle" not in err, err
