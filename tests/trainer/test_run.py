"""Shortened ``polyrl run`` of both tiny recipes: the metrics file, the run directory, seeds, resume, NaNs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from polyrl.core import algorithms as A
from polyrl.core.config import load_config

COMMON = [
    "step",
    "reward/mean",
    "loss/policy",
    "time/step_s",
    "rollout/logprob_diff",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "response/length_mean",
    "actor/pg_clipfrac",
    "train/nonfinite_skipped",
]
DAPO = [
    "dapo/groups_filtered",
    "dapo/gen_batches",
    "dapo/overlong_penalized",
    "actor/clipfrac_low",
    "actor/clipfrac_high",
]
PPO = ["loss/value", "critic/vf_clipfrac", "kl/reward_kl", "kl/coef", "critic/explained_var"]


@pytest.mark.parametrize(("recipe", "extra"), [("gpt_oss_dapo_tiny", DAPO), ("deepseek_ppo_tiny", PPO)])
def test_short_run_writes_the_run_directory(
    recipe: str, extra: list[str], tmp_path: Path, run_cli, read_metrics
) -> None:
    out = tmp_path / "run"
    rc, _, err = run_cli(
        [f"recipes/{recipe}.yaml", "--output", str(out), "--seed", "0", "trainer.total_steps=3", "data.batch_size=8"]
    )
    assert rc == 0, err
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in COMMON + extra:
        assert all(key in r for r in rows), key
        assert all(isinstance(r[key], (int, float)) and math.isfinite(r[key]) for r in rows), key
    # sampling logprobs from the engine agree with the trainer's recompute (same weights, fp32)
    assert max(r["rollout/logprob_diff"] for r in rows) < 1e-4
    assert 0.0 <= rows[0]["reward/mean"] <= 1.0
    # the written config is the fully resolved one, and loads back to the same config
    written = load_config(out / "config.yaml")
    assert written == load_config(
        f"recipes/{recipe}.yaml", ["trainer.total_steps=3", "data.batch_size=8", "trainer.seed=0", "backend.name=cpu"]
    )
    assert "extends" not in yaml.safe_load((out / "config.yaml").read_text())
    assert any((out / "events").iterdir())  # TensorBoard events
    assert (out / "checkpoints" / "step_00000003" / "COMPLETE").exists()  # the final model
    assert "done:" in err


def test_dapo_counts_overlong_and_filters_groups(tmp_path: Path, run_cli, read_metrics) -> None:
    out = tmp_path / "run"
    # max 5 tokens with a 4-token buffer: almost every random response is penalised
    rc, _, err = run_cli(
        [
            "gpt_oss_dapo_tiny",
            "--output",
            str(out),
            "trainer.total_steps=2",
            "data.batch_size=8",
            "rollout.max_response_length=5",
            "algorithm.overlong.buffer_length=4",
            "algorithm.dynamic_sampling.metric=acc",
        ]
    )
    assert rc == 0, err
    rows = read_metrics(out)
    assert all(r["dapo/overlong_penalized"] > 0 for r in rows)
    # by exact-match accuracy a random policy's groups are all-wrong: filtered, regenerated up to the bound
    assert all(r["dapo/groups_filtered"] > 0 and r["dapo/gen_batches"] == 3 for r in rows)


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _run_process(out: Path, seed: int) -> list[dict]:
    """A real `polyrl run` process (a fresh interpreter: nothing shared with the test process)."""
    env = dict(os.environ, POLYRL_DISABLE_PLUGIN_AUTOLOAD="1")
    cmd = [sys.executable, "-m", "polyrl", "run", "gpt_oss_dapo_tiny", "--seed", str(seed), "--output", str(out),
           "--no-progress", "trainer.total_steps=2", "data.batch_size=8"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return _comparable([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])


@pytest.mark.slow
def test_same_seed_same_run_and_other_seed_differs(tmp_path: Path) -> None:
    a, b, c = _run_process(tmp_path / "a", 3), _run_process(tmp_path / "b", 3), _run_process(tmp_path / "c", 4)
    assert a == b
    assert a != c


def _close(a: list[dict], b: list[dict], rel: float = 1e-5) -> bool:
    """Equal keys and values up to float reduction order (the in-process test cannot pin MKL's threads)."""
    if [sorted(r) for r in a] != [sorted(r) for r in b]:
        return False
    return all(math.isclose(x[k], y[k], rel_tol=rel, abs_tol=1e-7) for x, y in zip(a, b) for k in x)


def test_resume_continues_exactly(tmp_path: Path, run_cli, read_metrics) -> None:
    args = ["deepseek_ppo_tiny", "--seed", "1", "data.batch_size=16", "trainer.save_every=1"]
    rc, _, err = run_cli([*args, "--output", str(tmp_path / "straight"), "trainer.total_steps=3"])
    assert rc == 0, err
    rc, _, err = run_cli([*args, "--output", str(tmp_path / "split"), "trainer.total_steps=2"])
    assert rc == 0, err
    rc, _, err = run_cli([*args, "--output", str(tmp_path / "split"), "trainer.total_steps=3"])
    assert rc == 0, err
    assert "resuming" in err and "from step 2" in err
    straight, split = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in split] == [1, 2, 3]
    assert _close(_comparable(split), _comparable(straight))


def _nan_policy_loss(calls_to_poison: set[int]):
    real = A.policy_loss
    count = {"n": 0}

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        count["n"] += 1
        if count["n"] in calls_to_poison:
            loss = loss * float("nan")
        return loss, metrics

    return poisoned


def test_a_non_finite_update_is_skipped_and_counted(tmp_path: Path, run_cli, read_metrics, monkeypatch) -> None:
    monkeypatch.setattr(A, "policy_loss", _nan_policy_loss({1}))
    out = tmp_path / "run"
    rc, _, err = run_cli(["gpt_oss_dapo_tiny", "--output", str(out), "trainer.total_steps=2", "data.batch_size=8"])
    assert rc == 0, err
    rows = read_metrics(out)
    assert rows[-1]["train/nonfinite_skipped"] == 1
    assert (out / "checkpoints" / "step_00000002" / "COMPLETE").exists()


def test_non_finite_updates_in_a_row_abort_without_a_checkpoint(
    tmp_path: Path, run_cli, read_metrics, monkeypatch
) -> None:
    monkeypatch.setattr(A, "policy_loss", _nan_policy_loss(set(range(1, 100))))
    out = tmp_path / "run"
    rc, _, err = run_cli(
        [
            "gpt_oss_dapo_tiny",
            "--output",
            str(out),
            "trainer.total_steps=3",
            "data.batch_size=8",
            "trainer.max_nonfinite_in_row=2",
        ]
    )
    assert rc == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("polyrl run: backend cpu (polyrl ")  # the run log names its backend first
    assert len(lines) == 2 and "not finite" in lines[1] and "in a row" in lines[1]
    assert "Traceback" not in err
    assert not any((out / "checkpoints").glob("step_*"))


def test_weights_never_checkpointed_when_not_finite(tmp_path: Path, run_cli, read_metrics, monkeypatch) -> None:
    from polyrl.core.trainer.loop import Trainer

    monkeypatch.setattr(Trainer, "weights_finite", lambda self: False)
    out = tmp_path / "run"
    rc, _, err = run_cli(["gpt_oss_dapo_tiny", "--output", str(out), "trainer.total_steps=1", "data.batch_size=8"])
    assert rc == 0
    assert "not finite; checkpoint not written" in err
    assert not any((out / "checkpoints").glob("step_*"))


def test_dry_run_prints_the_config_and_writes_nothing(tmp_path: Path, run_cli, read_metrics) -> None:
    out = tmp_path / "run"
    rc, stdout, err = run_cli(["deepseek_ppo_tiny", "--dry-run", "--output", str(out), "optimizer.lr=2e-4"])
    assert rc == 0, err
    assert yaml.safe_load(stdout)["optimizer"]["lr"] == 2e-4
    assert not out.exists()


def test_metrics_are_json_lines(tmp_path: Path, run_cli, read_metrics) -> None:
    out = tmp_path / "run"
    rc, _, _ = run_cli(["gpt_oss_dapo_tiny", "--output", str(out), "trainer.total_steps=2", "data.batch_size=8"])
    assert rc == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # every line is one JSON object ...
    assert len(rows) == 2 and all(isinstance(r, dict) for r in rows)  # ... one per step, none missing
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the keys every consumer (report, TensorBoard, users' scripts) relies on, as finite numbers
        for key in ("step", "reward/mean", "loss/policy", "time/step_s"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r.get(key))
