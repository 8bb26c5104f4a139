"""Helpers for tests that start training processes (plain or under torchrun) and kill them."""

from __future__ import annotations

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
