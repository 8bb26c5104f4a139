"""LoRA under FSDP2: ``polyrl run --nproc 2`` of both tiny recipes with ``model.lora`` on (the adapters sharded with
their layers, rank 0's weights loaded into the other rank's meta skeleton, the PPO recipe's KL reference the actor
with its adapters off) gives the 1-process run's metrics within the distributed tolerance."""

from __future__ import annotations

import pytest
from dist_procs import child_env, read_metrics, run_to_end
from test_run_resume import COMPARED, run_cmd

from polyrl.core.tolerances import tolerance

pytestmark = pytest.mark.distributed

LORA = ("model.lora.enabled=true", "model.lora.rank=4", "optimizer.lr=1e-2")
# PPO's policy loss on whitened advantages is ~1e-8 (rounding noise): its value loss and the KL are compared instead
KEYS = {"gpt_oss_dapo_tiny": COMPARED,
        "deepseek_ppo_tiny": (*(k for k in COMPARED if not k.startswith("loss/")), "loss/value")}


@pytest.mark.parametrize("recipe", ["gpt_oss_dapo_tiny", "deepseek_ppo_tiny"])
def test_lora_on_two_processes_equals_one(tmp_path, recipe: str) -> None:
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"n{nproc}"
        run_to_end(run_cmd(out, total=2, nproc=nproc, extra=LORA, recipe=recipe),
                   env=child_env(POLYRL_DISABLE_PLUGIN_AUTOLOAD="1"), timeout=300)
        runs[nproc] = read_metrics(out)
    tol = tolerance("distributed.loss", "float32")
    assert [r["step"] for r in runs[2]] == [r["step"] for r in runs[1]] == [1, 2]
    for x, y in zip(runs[2], runs[1]):
        assert x["actor/grad_norm"] > 0
        assert ("actor/entropy" in x) == ("actor/entropy" in y), x["step"]  # the drift check's steps agree
        for key in (k for k in KEYS[recipe] if k in y):  # actor/entropy: on the drift check's steps only
            assert abs(x[key] - y[key]) <= tol * max(abs(y[key]), 1e-3), (x["step"], key, x[key], y[key])
        if recipe == "deepseek_ppo_tiny":  # the KL reference (the adapters off) on both
            assert abs(x["kl/reward_kl"] - y["kl/reward_kl"]) <= tol * max(abs(y["kl/reward_kl"]), 1e-3) + 1e-7
    if recipe == "deepseek_ppo_tiny":
        assert runs[1][1]["kl/reward_kl"] != 0.0  # after one update the adapters moved the actor off the reference
