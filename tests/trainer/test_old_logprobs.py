"""algorithm.old_logprobs: π_old recomputed by the trainer, or the engine's sampling log-probs (the trainer's forward
skipped except on the drift check's steps); what auto picks for which engine, what is refused, and what a step
computes and reports under each."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from polyrl.core.config import AlgorithmConfig, RolloutCorrectionConfig, load_config
from polyrl.core.errors import BadInputError
from polyrl.core.trainer.mismatch import resolve_old_logprobs

SHORT = ["trainer.total_steps=3", "data.batch_size=8", "trainer.save_every=0"]


@pytest.mark.parametrize(
    ("mode", "own_weights", "correction_on", "replay", "engine"),
    [
        ("auto", False, False, "off", True),  # hf: the engine samples with the trainer's own model
        ("auto", False, False, "r3", True),
        ("auto", True, False, "off", False),  # vllm: its own weights and kernels
        ("auto", True, True, "off", False),
        ("auto", False, True, "off", False),  # the correction compares μ with the recomputed π_old
        ("auto", False, False, "r2", False),  # r2 replays the routing of the recomputing forward
        ("recompute", False, False, "off", False),
        ("engine", True, False, "off", True),  # verl's bypass: allowed for any engine when nothing needs π_old
    ],
)
def test_what_each_mode_resolves_to(mode, own_weights, correction_on, replay, engine) -> None:
    alg = AlgorithmConfig(old_logprobs=mode)
    use, line = resolve_old_logprobs(alg, "vllm" if own_weights else "hf", own_weights, correction_on, replay)
    assert use is engine
    assert line.startswith("old log-probs from the engine" if engine else "old log-probs recomputed by the trainer")
    assert (f"algorithm.old_logprobs={mode}" in line) == (mode != "auto")


def test_the_check_cadence_is_in_the_run_log_line() -> None:
    _, line = resolve_old_logprobs(AlgorithmConfig(old_logprobs_check_every=7), "hf", False, False, "off")
    assert "every 7 steps as a drift check" in line
    _, line = resolve_old_logprobs(AlgorithmConfig(old_logprobs_check_every=0), "hf", False, False, "off")
    assert line.endswith("no drift check")


def test_engine_with_a_correction_resolved_on_is_refused() -> None:
    with pytest.raises(BadInputError, match=r"old_logprobs=engine.*rollout correction is on for engine vllm"):
        resolve_old_logprobs(AlgorithmConfig(old_logprobs="engine"), "vllm", True, True, "off")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.old_logprobs_check_every=-1"], "old_logprobs_check_every: expected an integer >= 0"),
        (["algorithm.old_logprobs=engine", "algorithm.rollout_correction.enable=true"], "every weight is 1"),
        (["algorithm.old_logprobs=engine", "rollout.routing_replay=r2"], "routing_replay=r2"),
        (["algorithm.old_logprobs=trainer"], "algorithm.old_logprobs"),
    ],
)
def test_contradictions_are_refused_when_the_recipe_loads(overrides, message) -> None:
    with pytest.raises(BadInputError, match=message):
        load_config("recipes/gpt_oss_dapo_tiny.yaml", overrides)


def test_a_refusal_is_one_line_and_exit_2(tmp_path: Path, run_cli) -> None:
    out = tmp_path / "run"
    rc, _, err = run_cli(["gpt_oss_dapo_tiny", "--output", str(out), *SHORT, "algorithm.old_logprobs=engine",
                          "algorithm.rollout_correction.enable=true"])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not out.exists()


def _trainer(recipe: str, *overrides: str):
    from polyrl.core import distributed as D
    from polyrl.core.plugins.selection import set_active_backend
    from polyrl.core.trainer import Trainer

    cfg = load_config(f"recipes/{recipe}.yaml", [*SHORT, "backend.name=cpu", "trainer.num_threads=1", *overrides])
    backend = set_active_backend("cpu")
    D.init_distributed(backend)
    return Trainer(cfg, backend)


def _count_actor_forwards(trainer, monkeypatch) -> list[int]:
    """The actor's forwards in the trainer's views (the reference's, PPO's KL, are counted apart: they always run)."""
    from polyrl.core.trainer import loop

    calls = [0]
    real = loop.policy_forward

    def counted(model, *args, **kwargs):
        calls[0] += model is trainer.models.actor
        return real(model, *args, **kwargs)

    monkeypatch.setattr(loop, "policy_forward", counted)
    return calls


@pytest.mark.parametrize("recipe", ["gpt_oss_dapo_tiny", "deepseek_ppo_tiny"])
def test_engine_log_probs_skip_the_actor_forward_except_on_check_steps(recipe: str, monkeypatch) -> None:
    trainer = _trainer(recipe, "algorithm.old_logprobs_check_every=2")
    assert trainer.old_logp_from_engine and trainer.algorithm.old_logprobs == "engine"
    calls = _count_actor_forwards(trainer, monkeypatch)
    seen = []
    for step in range(3):
        trainer.state.step = step  # the check runs where state.step % 2 == 0: steps 0 and 2
        before = calls[0]
        exp = trainer.collect()
        batch = exp.batch
        assert torch.equal(exp.old_logp, batch.rollout_logp)  # π_old is μ, bit for bit
        assert exp.old_logp.data_ptr() != batch.rollout_logp.data_ptr()  # a copy: the update may not alias μ
        inputs = trainer.prepare_update(exp)
        assert inputs.is_weights is None and inputs.loss_mask is None
        checked = step % 2 == 0
        seen.append(calls[0] - before)
        assert (exp.check_logp is not None) == checked
        assert (exp.view_metrics.rollout_logprob_diff is not None) == checked
        assert (exp.view_metrics.actor_entropy is not None) == checked
        assert (inputs.metrics.mismatch is not None) == checked
        if checked:  # the trainer's forward measures the drift; it replaces nothing
            assert 0 < exp.view_metrics.rollout_logprob_diff < 1e-4
            assert not torch.equal(exp.check_logp, batch.rollout_logp)  # a KV-cached decode rounds otherwise
            assert inputs.metrics.mismatch.mismatch_applied == 0
            assert abs(inputs.metrics.mismatch.mismatch_k1) < 1e-6
    assert seen[0] > 0 and seen[1] == 0 and seen[2] > 0


def test_recompute_runs_the_actor_forward_every_step(monkeypatch) -> None:
    trainer = _trainer("gpt_oss_dapo_tiny", "algorithm.old_logprobs=recompute")
    assert not trainer.old_logp_from_engine and trainer.algorithm.old_logprobs == "recompute"
    calls = _count_actor_forwards(trainer, monkeypatch)
    for step in range(2):
        trainer.state.step = step
        before = calls[0]
        exp = trainer.collect()
        assert calls[0] > before and exp.check_logp is None
        assert not torch.equal(exp.old_logp, exp.batch.rollout_logp)  # the trainer's own forward
        assert torch.allclose(exp.old_logp, exp.batch.rollout_logp, atol=1e-4)
        assert trainer.prepare_update(exp).metrics.mismatch is not None


def test_engine_and_recompute_learn_the_same_first_step() -> None:
    """Same seed, same samples: the two π_old differ by rounding only, so the first update's loss and gradient
    norm agree to that rounding (not bit for bit)."""
    rows = {}
    for mode in ("engine", "recompute"):
        trainer = _trainer("gpt_oss_dapo_tiny", f"algorithm.old_logprobs={mode}")
        rows[mode] = trainer.step()
    a, b = rows["engine"], rows["recompute"]
    assert a["reward/mean"] == b["reward/mean"]  # the rollout is before either
    for key in ("loss/policy", "actor/grad_norm"):
        assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-7), key


def test_the_schema_default_is_auto() -> None:
    alg = AlgorithmConfig()
    assert alg.old_logprobs == "auto" and alg.old_logprobs_check_every == 10
    assert dataclasses.replace(alg, rollout_correction=RolloutCorrectionConfig()).old_logprobs == "auto"
