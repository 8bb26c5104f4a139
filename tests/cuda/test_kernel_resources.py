"""bench/kernel_resources.py: the attention kernels compiled ahead of time for Hopper on a machine without a GPU
(Triton's ptxas), their registers / spills / shared memory and SASS counts read back from the cubin.

The compile needs TRITON_INTERPRET unset, which this test session sets for the interpreter tests: the script runs
in a child process with it removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "kernel_resources.py"


def _run(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=600)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_hopper_code_uses_wgmma_and_ampere_code_does_not(tmp_path):
    sweep = tmp_path / "sweep.json"  # an attention_sweep.py JSON, shape as that script writes it
    sweep.write_text(json.dumps({"results": [{"layout": "4x4096", "window": None, "kernels": {"dkdv": {"rows": [
        {"config": "M64 N64 w4 s2", "ms": 4.03}, {"config": "M64 N64 w4 s3", "ms": 4.18}]}},
        "default_fwd_bwd_kernels_ms": 7.59, "fa4_fwd_bwd_ms": 4.83}]}))
    proc, hopper = _run(tmp_path, "--kernels", "dkdv", "--configs", "1", "--sweep", str(sweep))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = hopper["rows"]
    assert row["config"] == [64, 64, 4, 2] and row["measured_ms"] == [4.03]  # the default, matched to its own row
    assert 0 < row["registers"] <= 255 and row["stack_bytes"] >= 0 and row["shared_bytes"] > 0
    # four bf16 dots per step on sm_90: warpgroup MMAs; sm_80 has none and multiplies with mma.sync (HMMA)
    assert row["HGMMA"] > 0 and row["instructions"] > 0
    proc, ampere = _run(tmp_path, "--kernels", "dkdv", "--configs", "1", "--capability", "80")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ampere["rows"][0]["HGMMA"] == 0 and ampere["capability"] == 80
    out = _run(tmp_path, "--kernels", "dkdv", "--configs", "1", "--sweep", str(sweep))[0].stdout
    assert "4.030" in out and "FA4 4.830 ms, ratio 1.57" in out  # ours beside the peer of the same GPU run


@pytest.mark.parametrize("args, message", [
    (("--kernels", "bwd"), "unknown kernel(s) bwd"),
    (("--windows", "wide"), "--windows 'wide'"),
    (("--windows", "0"), "a window is at least 1 key"),
    (("--sweep", "/nonexistent/sweep.json"), "--sweep /nonexistent/sweep.json: FileNotFoundError"),
])
def test_bad_arguments_exit_2(tmp_path, args, message):
    proc, _ = _run(tmp_path, *args)
    assert proc.returncode == 2 and message in proc.stderr


def test_the_interpreter_is_refused(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--configs", "1"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 2 and "unset TRITON_INTERPRET" in proc.stderr
