"""bench/recipe_tiny.py's per-run summary: rewards, the wall bar, and the wall spent outside the steps."""

from __future__ import annotations

import json
from pathlib import Path

from bench_scripts import load_bench


def _run_dir(tmp_path: Path, rewards: list[float], step_s: float) -> Path:
    lines = [json.dumps({"reward/mean": r, "time/step_s": step_s}) for r in rewards]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_outside_steps_is_the_wall_less_the_steps(tmp_path):
    bench = load_bench("recipe_tiny")
    rewards = [0.0] * 10 + [1.0] * 10
    res = bench._summarise("gpt_oss_dapo_tiny", 0, 31.0, 0, _run_dir(tmp_path, rewards, 0.75), "", backend="cuda")
    assert res["steps_s"] == 15.0 and res["outside_steps_s"] == 16.0
    assert res["reward_first10"] == 0.0 and res["reward_last10"] == 1.0
    assert res["wall_bar_s"] == 30.0 and not res["meets_bar"]  # 31 s > the 30 s GPU bar
    ok = bench._summarise("gpt_oss_dapo_tiny", 0, 29.0, 0, _run_dir(tmp_path, rewards, 0.75), "", backend="cuda")
    assert ok["meets_bar"] and ok["outside_steps_s"] == 14.0


def test_a_run_without_metrics_has_no_step_split(tmp_path):
    res = load_bench("recipe_tiny")._summarise("deepseek_ppo_tiny", 1, 5.0, 2, tmp_path, "boom", backend=None)
    assert res["steps"] == 0 and res["steps_s"] is None and res["outside_steps_s"] is None
    assert not res["meets_bar"] and res["tail"] == "boom"
