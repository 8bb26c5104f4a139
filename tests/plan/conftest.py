"""The dry run through the CLI, in a directory with no data file or checkpoint (the plan is made without them)."""

from __future__ import annotations

import pytest

from polyrl.cli import main as polyrl_main
from polyrl.core.plugins.selection import reset_active_backend


@pytest.fixture
def cli(capsys, tmp_path, monkeypatch):
    """``cli(*args)`` runs ``polyrl run *args`` in-process: (exit code, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str, str]:
        reset_active_backend()
        rc = polyrl_main(["run", *args])
        out, err = capsys.readouterr()
        return rc, out, err

    return run
