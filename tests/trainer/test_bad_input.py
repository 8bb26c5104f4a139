"""Every kind of bad input to ``polyrl run`` exits 2 with one line, no traceback, and leaves an existing run
directory exactly as it was (recipe path, YAML syntax, unknown key, wrong type, unknown backend, missing data
file, a data row without the needed field)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def existing_run(tmp_path: Path) -> Path:
    """A run directory from an earlier run: a bad command pointed at it must not change a byte."""
    run = tmp_path / "existing"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("trainer: {total_steps: 3}\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    return run


def _math_recipe(tmp_path: Path, data: Path) -> Path:
    recipe = tmp_path / f"math_{data.stem}.yaml"
    # the full recipe (math data): the data file is read before any model is built
    recipe.write_text(f"extends: recipes/gpt_oss_dapo.yaml\ndata:\n  path: {data}\n  answer_key: answer\n")
    return recipe


def _cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("trainer:\n  total_steps: [1, 2\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps({"prompt": "2+2?"}) + "\n")
    return {
        "recipe path": (["recipes/no_such_recipe.yaml"], "recipe not found"),
        "yaml syntax": ([str(bad_yaml)], "YAML syntax error"),
        "unknown key": (["gpt_oss_dapo_tiny", "optimizer.learning_rate=1e-3"], "unknown key 'optimizer.learning_rate'"),
        "wrong type": (["gpt_oss_dapo_tiny", "data.batch_size=lots"], "data.batch_size: expected int"),
        "unknown backend": (["gpt_oss_dapo_tiny", "--backend", "tpu9000"], "unknown backend 'tpu9000'"),
        "missing data file": ([str(_math_recipe(tmp_path, tmp_path / "nope.parquet"))], "nope.parquet"),
        "row without field": ([str(_math_recipe(tmp_path, rows))], "answer"),
    }


CASES = ["recipe path", "yaml syntax", "unknown key", "wrong type", "unknown backend", "missing data file",
         "row without field"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_with_one_line(case: str, tmp_path: Path, existing_run: Path, run_cli) -> None:
    args, needle = _cases(tmp_path)[case]
    before = _snapshot(existing_run)
    rc, out, err = run_cli([*args, "--output", str(existing_run)])
    assert rc == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("polyrl run: error:") and needle in lines[0]
    assert "Traceback" not in err and out == ""
    assert _snapshot(existing_run) == before


@pytest.mark.parametrize("case", CASES)
def test_bad_input_creates_no_run_directory(case: str, tmp_path: Path, run_cli) -> None:
    args, _ = _cases(tmp_path)[case]
    fresh = tmp_path / "fresh"
    rc, _, _ = run_cli([*args, "--output", str(fresh)])
    assert rc == 2 and not fresh.exists()


def test_bad_input_through_the_console_script(tmp_path: Path, existing_run: Path) -> None:
    """The real process: exit status 2, a single stderr line, nothing else, from another directory."""
    before = _snapshot(existing_run)
    env = dict(os.environ, POLYRL_DISABLE_PLUGIN_AUTOLOAD="1")
    proc = subprocess.run(
        [sys.executable, "-m", "polyrl", "run", "recipes/gpt_oss_dapo_tiny.yaml", "algorithm.clip_high=wide",
         "--output", str(existing_run)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "polyrl run: error: algorithm.clip_high: expected float, got str 'wide'"
    ]
    assert proc.stdout == ""
    assert _snapshot(existing_run) == before
