"""Helpers for tests that start training processes (plain or under torchrun) and kill them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOY = Path(__file__).with_name("toy_worker.py")


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def toy_command(run_dir: Path, steps: int, save_every: int, nproc: int = 1) -> list[str]:
    args = [str(TOY), str(run_dir), str(steps), str(save_every)]
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]


def run_to_end(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 180) -> None:
    proc = subprocess.run(cmd, env=env or child_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def run_and_kill(cmd: list[str], when: Callable[[], bool], env: dict[str, str], timeout: float = 120) -> None:
    """Start ``cmd`` in its own process group and SIGKILL the whole group once ``when()`` is true."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not when():
            if proc.poll() is not None:
                raise AssertionError(f"process ended before the kill point:\n{proc.stderr.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("kill point never reached")
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line]


# --- process trees of `polyrl run --nproc N` ------------------------------------------------------------
def tree_pids(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker`` (a run's unique --output path): the launcher,
    torchrun's agent and the workers. Zombies have an empty command line and are not listed."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def wait_for(what: Callable[[], bool], timeout: float, message: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{message}: the run ended first (exit {proc.returncode})")
        if time.monotonic() > deadline:
            raise AssertionError(f"{message}: not within {timeout:.0f} s")
        time.sleep(0.05)


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def metric_lines(run_dir: Path) -> list[str]:
    path = run_dir / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []
