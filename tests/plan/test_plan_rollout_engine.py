"""The memory plan with the vllm rollout engine: its own copy of the weights and its share of the device
(gpu_memory_utilization) counted, and a share the weights overflow refused in one line saying what to change.

GPT-OSS-20B in bf16 is 39 GiB of weights: one full copy per device at tensor parallel 1, more than 0.6 of a
64 GB NPU (the ascend backend's share for vLLM), so vllm-ascend could not start beside the trainer on 8 x 64 GB;
the hf engine (generation on the trainer's own weights) fits, and so would the engine's weights halved (tensor
parallel 2)."""

from __future__ import annotations

import pytest

from polyrl.core.config import load_config
from polyrl.core.plan import plan_memory
from polyrl.core.plan.rollout import SHARE_ROW, WEIGHTS_ROW
from polyrl.core.plugins.registry import get_registry
from polyrl.core.plugins.selection import reset_active_backend

GIB = 2**30


def _plan(backend_name: str, *overrides: str, nproc: int = 8):
    backend = get_registry().backends[backend_name]
    return plan_memory(load_config("gpt_oss_dapo", list(overrides)), backend, nproc=nproc)


def test_the_vllm_engine_on_8_npus_of_64_gb_is_refused_saying_what_to_change() -> None:
    plan = _plan("ascend", "rollout.engine=vllm")
    assert plan.engine == "vllm"
    assert plan.rows[WEIGHTS_ROW] == pytest.approx(plan.params["actor"] * 2 / GIB, rel=1e-6)  # bf16, one full copy
    assert plan.rows[SHARE_ROW] == pytest.approx(0.6 * 64)
    # the trainer's resident state + the engine's share alone would fit: the weights inside the share do not
    assert plan.peak_gib <= plan.usable_gib and not plan.fits
    line = plan.advice()
    assert "\n" not in line and "the vllm engine's own weights (39.0 GiB at tensor parallel 1)" in line
    assert "38.4 GiB = 0.6 x 64" in line and "set rollout.engine=hf" in line
    assert "rollout engine does NOT fit" in plan.text()
    # the rollout phase counts the share on top of what the trainer keeps (its gradients freed)
    static = plan.rows["parameters"] + plan.rows["gradients"] + plan.rows["optimizer state (2 Adam states)"]
    assert plan.phases["rollout"] == pytest.approx(static - plan.rows["gradients"] + 0.6 * 64)
    assert plan.phases["update"] < plan.phases["rollout"]  # asleep (level 1) during the update


def test_the_hf_engine_fits_and_the_vllm_engine_fits_on_80_gb_or_at_tensor_parallel_2(monkeypatch) -> None:
    assert _plan("ascend", "rollout.engine=hf").fits
    # cuda sizes the engine's KV cache to the rollout (every layer counted full, as the engine allocates it): 16
    # sequences of 22,528 tokens are 20.7 GiB beside its 39 GiB copy, 4 GiB over 8 GPUs of 80 GB; 8 sequences fit
    cuda = _plan("cuda", "rollout.engine=vllm")
    assert not cuda.fits and not cuda.engine_problem
    assert cuda.rows[SHARE_ROW] == pytest.approx(cuda.rows[WEIGHTS_ROW] + 20.7 + 2.0, abs=0.05)
    assert _plan("cuda", "rollout.engine=vllm", "rollout.micro_batch_size=8").fits
    ascend = type(get_registry().backends["ascend"])
    options = ascend.rollout_engine_options
    monkeypatch.setattr(ascend, "rollout_engine_options", lambda self, engine: {
        **options(self, engine), "llm_kwargs": {"tensor_parallel_size": 2}})
    plan = _plan("ascend", "rollout.engine=vllm")
    assert plan.rows[WEIGHTS_ROW] == pytest.approx(plan.params["actor"] * 2 / 2 / GIB, rel=1e-6) and plan.fits


def test_the_dry_run_refuses_in_one_line(capsys, tmp_path, monkeypatch) -> None:
    from polyrl.cli import main

    monkeypatch.chdir(tmp_path)
    reset_active_backend()
    rc = main(["run", "recipes/gpt_oss_dapo.yaml", "--dry-run", "--backend", "ascend", "--nproc", "8",
               "rollout.engine=vllm"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "not checked: file absent" not in line]
    assert rc == 2 and len(err) == 1 and err[0].startswith("polyrl run: error: memory plan: the vllm engine's own")
