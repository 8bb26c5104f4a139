"""Issue 12 "done when", on the real trainer under ``polyrl run --nproc 2`` (CPU, gloo): workers die with
their launcher, one live run per directory, a run SIGKILLed as a whole tree at random moments resumes to
the uninterrupted run's metrics (each step once), and two identical runs give identical metrics on a
loaded machine.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dist_procs import child_env, kill_all, metric_lines, read_metrics, run_to_end, tree_pids, wait_for

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOTAL, SAVE_EVERY = 6, 2
# The tiny recipe's own threads (2 per process) and a global batch of 8 prompts x 8 samples, large enough
# that the backward of the MoE expert-bias gather takes torch's multi-threaded CPU index_put path (the
# source of load-dependent results without deterministic algorithms). No dynamic sampling (its extra
# generation batches cost time, not coverage); checkpoints every 2 steps.
RUN = ["data.batch_size=8", "algorithm.dynamic_sampling.enable=false", f"trainer.save_every={SAVE_EVERY}"]


def run_cmd(out: Path, *, total: int = TOTAL, nproc: int = 2, extra: tuple[str, ...] = tuple(RUN)) -> list[str]:
    return [sys.executable, "-m", "polyrl", "run", "gpt_oss_dapo_tiny.yaml", "--output", str(out), "--no-progress",
            "--nproc", str(nproc), f"trainer.total_steps={total}", *extra]  # fmt: skip


def without_time(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics]


@contextlib.contextmanager
def started(cmd: list[str], out: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """``cmd`` running in a session of its own; whatever is left of its process tree is killed on exit."""
    log = out.parent / f"{out.name}.stderr"
    with open(log, "ab") as err:
        proc = subprocess.Popen(cmd, env=env or child_env(), stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
    try:
        yield proc
    finally:
        kill_all(tree_pids(str(out)))
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def workers_started(out: Path) -> bool:
    """The agent and both workers are up (launcher + agent + 2 workers carry the output path)."""
    return len(tree_pids(str(out))) >= 4


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file and directory under ``root``: size, mtime and (for files) content."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, p.read_bytes() if p.is_file() else b"")
    return out


# --- the uninterrupted reference, twice ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    """Two uninterrupted 2-process runs of the same command, at the same time: each loads the 2-core
    machine for the other (4 workers x 2 threads), so thread scheduling differs between them."""
    dirs = [tmp_path_factory.mktemp(name) / "run" for name in ("a", "b")]
    procs = [subprocess.Popen(run_cmd(d), env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for d in dirs]
    try:
        errs = [p.communicate(timeout=600)[1].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = []
    for d, p, err in zip(dirs, procs, errs):
        assert p.returncode == 0, err[-3000:]
        metrics = read_metrics(d)
        assert [m["step"] for m in metrics] == list(range(1, TOTAL + 1))
        out.append(without_time(metrics))
    assert len({m["reward/mean"] for m in out[0]}) > 1  # it is really sampling and learning
    return out[0], out[1]


@pytest.fixture(scope="module")
def reference(runs: tuple[list[dict], list[dict]]) -> list[dict]:
    return runs[0]


def test_two_identical_two_process_runs_give_identical_metrics(runs: tuple[list[dict], list[dict]]) -> None:
    a, b = runs
    for x, y in zip(a, b):
        assert x == y, {k: (x[k], y.get(k)) for k in x if x[k] != y.get(k)}


# --- workers die with their launcher -----------------------------------------------------------------------
@pytest.mark.parametrize("fallback", [False, True], ids=["parent-death-signal", "watchdog-only"])
def test_launcher_sigkill_ends_every_worker_and_nothing_is_written_after(tmp_path: Path, fallback: bool) -> None:
    """SIGKILL of the launcher alone (not its tree): within 15 s no process of the run is left, and nothing
    is written once the launcher is dead, but for a line already in flight: a worker checks its lifeline just
    before each metrics line, so a line whose check passed while the launcher was still being torn down may
    land after the kill (seen once in CI). A worker that outlived its launcher would write a line per step
    (~0.1 s) until killed. ``watchdog-only`` disables the kernel's parent-death signal, so the watchdog thread
    alone must end the agent and the workers."""
    out = tmp_path / "run"
    env = child_env(POLYRL_TEST_NO_PDEATHSIG="1") if fallback else child_env()
    with started(run_cmd(out, total=200), out, env) as proc:
        wait_for(lambda: len(metric_lines(out)) >= 1, 180, "first step", proc)
        tree = tree_pids(str(out))
        assert proc.pid in tree and len(tree) >= 4, tree  # launcher, agent, 2 workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()  # the launcher is gone: from here a worker's lifeline check fails
        at_kill = metric_lines(out)
        wait_for(lambda: not tree_pids(str(out)), 15, f"processes of the run still alive: {tree_pids(str(out))}")
        time.sleep(1.0)
        after = metric_lines(out)
        assert after[:len(at_kill)] == at_kill and len(after) <= len(at_kill) + 1, (len(at_kill), len(after))


# --- one live run per directory ----------------------------------------------------------------------------
def test_second_run_on_a_live_directory_exits_2_and_changes_nothing(tmp_path: Path) -> None:
    """A live run (held still inside a checkpoint write by the test hook, so its directory is quiet);
    the same command again, with --nproc 2 and with one process: exit 2, one line naming the holder's pid
    and host, and not a byte or an mtime of the directory changes."""
    import socket

    out = tmp_path / "run"
    env = child_env(POLYRL_TEST_CHECKPOINT_DELAY_S="300", POLYRL_TEST_CHECKPOINT_DELAY_STEP="2")
    with started(run_cmd(out), out, env) as proc:
        partial = out / "checkpoints" / "step_00000002.tmp" / "extra"
        wait_for(lambda: (partial / "rank_0.pt").exists() and (partial / "rank_1.pt").exists(), 180,
                 "checkpoint 2 written", proc)
        time.sleep(0.5)
        before = snapshot(out)
        for nproc in (2, 1):
            second = subprocess.run(run_cmd(out, nproc=nproc), env=child_env(), capture_output=True, text=True,
                                    timeout=120)
            lines = [line for line in second.stderr.splitlines() if line.strip()]
            assert second.returncode == 2, second.stderr
            assert len(lines) == 1, second.stderr
            assert "in use by a live run" in lines[0] and f"pid {proc.pid} on host {socket.gethostname()}" in lines[0]
            assert snapshot(out) == before
        assert proc.poll() is None  # the live run was not disturbed


# --- whole-tree SIGKILL (and SIGTERM) at random moments -------------------------------------------------------
def _stop_at(out: Path, when, *, env: dict[str, str] | None = None, extra_s: float = 0.0,
             sig: int = signal.SIGKILL) -> None:
    """Start the command; once ``when()`` holds and ``extra_s`` more seconds have passed, SIGKILL every
    process of the run at once (a scheduler or the OOM killer taking the whole job), or SIGTERM the
    launcher alone and check that every process stops cleanly."""
    with started(run_cmd(out), out, env) as proc:
        wait_for(lambda: workers_started(out) and when(), 180, "stop point", proc)
        time.sleep(extra_s)
        assert proc.poll() is None, "the run ended before the stop moment"
        if sig == signal.SIGKILL:
            kill_all(tree_pids(str(out)))
            return
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=60) == 128 + sig
        wait_for(lambda: not tree_pids(str(out)), 15, "processes of the run still alive")
    err = (out.parent / f"{out.name}.stderr").read_text()
    assert "Traceback" not in err and "terminate called" not in err, err
    # one line from rank 0 (torchrun's agent logs its own lines around it, in any order)
    stopped = [line for line in err.splitlines() if "stopped by" in line]
    assert len(stopped) == 1 and stopped[0].startswith(f"polyrl run: stopped by {signal.Signals(sig).name} at step "), err


@pytest.mark.parametrize("after_s", [0.0, 1.5], ids=["interpreters-starting", "imports-and-setup"])
def test_sigterm_while_the_workers_start_stops_every_process_with_one_line(tmp_path: Path, after_s: float) -> None:
    """A stop that finds the workers before their handlers exist (a worker's interpreter still starting dies
    of the signal without a word) or inside the setup: the launcher still prints the one stop line, exit 143,
    no traceback, nothing left running."""
    _stop_at(tmp_path / "run", lambda: True, extra_s=after_s, sig=signal.SIGTERM)


def _random_moment(out: Path, rng: random.Random) -> tuple:
    """When 0..TOTAL-2 steps are logged (counting the lines already there: a resumed run cuts them back
    first, so a low count can fall inside the resume itself), plus 0..0.6 s: inside a step, a checkpoint
    write or the resume, always with at least two steps left to run."""
    base = len(metric_lines(out))
    target = rng.randint(min(base, TOTAL - 2), TOTAL - 2)
    return (lambda: len(metric_lines(out)) >= target), rng.uniform(0.0, 0.6)


@pytest.mark.parametrize("seed", [0, 1])
def test_killed_at_random_moments_then_same_command_gives_the_uninterrupted_metrics(
    reference: list[dict], tmp_path: Path, seed: int
) -> None:
    """Stops at seeded random moments, each followed by the same command; the last one runs to the end:
    metrics.jsonl equals the uninterrupted run's (apart from time/*), each step once, and TensorBoard holds
    the same steps. Seed 0: a whole-tree SIGKILL while checkpoint 4 is being written (held there by the test
    hook: the run resumes from checkpoint 2), then one at a random moment. Seed 1: SIGTERM at a random
    moment (every process stops cleanly), then a whole-tree SIGKILL at a random moment."""
    rng = random.Random(seed)
    out = tmp_path / "run"
    if seed == 0:
        env = child_env(POLYRL_TEST_CHECKPOINT_DELAY_S="300", POLYRL_TEST_CHECKPOINT_DELAY_STEP="4")
        partial = out / "checkpoints" / "step_00000004.tmp" / "extra"
        _stop_at(out, lambda: (partial / "rank_1.pt").exists(), env=env)
        assert not (out / "checkpoints" / "step_00000004").exists()
        assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    else:
        when, extra_s = _random_moment(out, rng)
        _stop_at(out, when, extra_s=extra_s, sig=signal.SIGTERM)
    when, extra_s = _random_moment(out, rng)
    _stop_at(out, when, extra_s=extra_s)
    run_to_end(run_cmd(out))  # the lock of the killed run died with it
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, TOTAL + 1))
    assert without_time(metrics) == reference
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "events"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == list(range(1, TOTAL + 1))
    assert [e.value for e in events.Scalars("reward/mean")] == pytest.approx([m["reward/mean"] for m in reference])
