"""`polyrl run --backend ascend --emulate`: the ascend backend's real code trains on the CPU through the torch_npu
emulator (not an NPU), and its first steps match the cpu backend's. The emulated run is a subprocess: it puts the
emulator in sys.modules and switches the backend to CPU mode, which must not leak into other tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl.cli import main as polyrl_main
from polyrl.core.errors import BadInputError
from polyrl.core.plugins.selection import reset_active_backend
from polyrl.core.tolerances import check_close
from polyrl.emulation import enable_emulation

ARGS = ["--seed", "0", "trainer.total_steps=2", "data.batch_size=8", "trainer.save_every=0", "--no-progress"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def cpu_metrics(tmp_path_factory) -> list[dict]:
    """The cpu backend's run with the same arguments (once for the module)."""
    out = tmp_path_factory.mktemp("cpu") / "run"
    reset_active_backend()
    assert polyrl_main(["run", "gpt_oss_dapo_tiny", "--backend", "cpu", "--output", str(out), *ARGS]) == 0
    return _metrics(out)


@pytest.mark.parametrize("sink_route", ["native", "lse"])
def test_emulated_run_trains_like_the_cpu_backend(tmp_path, cpu_metrics, sink_route):
    env = {**os.environ, "POLYRL_ASCEND_SINK": sink_route, "OMP_NUM_THREADS": "1"}
    env.pop("POLYRL_ASCEND_ON_CPU", None)
    out = tmp_path / "ascend"
    proc = subprocess.run([sys.executable, "-m", "polyrl", "run", "gpt_oss_dapo_tiny", "--backend", "ascend",
                           "--emulate", "--output", str(out), *ARGS], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "backend ascend" in proc.stderr
    got, ref = _metrics(out), cpu_metrics
    assert [r["step"] for r in got] == [1, 2]
    for key in ("reward/mean", "loss/policy", "actor/grad_norm"):
        err, bar, ok = check_close("recipe.emulated_steps", torch.tensor([r[key] for r in got]),
                                   torch.tensor([r[key] for r in ref]), torch.float32)
        assert ok, (key, err, bar)


def test_emulate_refuses_a_backend_without_an_emulator(capsys, tmp_path):
    with pytest.raises(BadInputError, match="has no emulator"):
        enable_emulation("cuda")
    reset_active_backend()
    rc = polyrl_main(["run", "gpt_oss_dapo_tiny", "--backend", "cpu", "--emulate", "--output", str(tmp_path / "x")])
    assert rc == 2 and "--emulate: backend 'cpu' has no emulator" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
