"""Two emulated Ascend processes train both tiny recipes under HCCL's rules, as two cpu processes do.

``polyrl run --backend ascend --emulate --nproc 2``: every collective goes through the emulated HCCL process
group (gloo with HCCL's dtype and reduce-op rules, polyrl.emulation.hccl), the attention and the MoE
experts through the torch_npu emulator — on the CPU, not an NPU. The ascend backend trains with FSDP2 mixed
precision (bfloat16 compute, float32 reductions: its sharding policy), the cpu backend in float32, so the first
update is compared with the step-parity bars of bfloat16 (polyrl.core.tolerances ``step.*``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl.core.tolerances import check_close

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
REPO = Path(__file__).resolve().parents[2]
BATCH = {"gpt_oss_dapo_tiny": 8, "deepseek_ppo_tiny": 32}


def _run(recipe: str, backend: str, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("POLYRL_ASCEND_ON_CPU", None)
    cmd = [sys.executable, "-m", "polyrl", "run", recipe, "--backend", backend, "--nproc", "2", "--output", str(out),
           "--seed", "0", "trainer.total_steps=2", f"data.batch_size={BATCH[recipe]}", "trainer.save_every=0",
           "--no-progress", *(["--emulate"] if backend == "ascend" else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("recipe", sorted(BATCH))
def test_two_emulated_ascend_processes_train_like_two_cpu_processes(tmp_path, recipe) -> None:
    got, ref = _run(recipe, "ascend", tmp_path / "ascend"), _run(recipe, "cpu", tmp_path / "cpu")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2]
    for key, bar in (("loss/policy", "step.loss"), ("actor/grad_norm", "step.grad_norm")):
        err, tol, ok = check_close(bar, torch.tensor(got[0][key]), torch.tensor(ref[0][key]), torch.bfloat16)
        assert ok, (key, err, tol)
    assert all(torch.isfinite(torch.tensor(r["loss/policy"])) for r in got)
