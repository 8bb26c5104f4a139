"""Shared fixtures for the trainer tests: ``polyrl run`` in-process, and reading a run's metrics."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from polyrl.cli import main as polyrl_main
from polyrl.core.plugins.selection import reset_active_backend


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture) -> Callable[[list[str]], tuple[int, str, str]]:
    """``run_cli(args) -> (exit code, stdout, stderr)`` of ``polyrl run ARGS --no-progress``."""

    def run(args: list[str]) -> tuple[int, str, str]:
        reset_active_backend()
        rc = polyrl_main(["run", *args, "--no-progress"])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@pytest.fixture
def read_metrics() -> Callable[[Path], list[dict]]:
    def read(run_dir: Path) -> list[dict]:
        text = (run_dir / "metrics.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    return read
