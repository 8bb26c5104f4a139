"""Sharding + checkpoints on a toy FSDP2 loop (tests/distributed/toy_worker.py), independent of the
trainer: N-rank vs 1-rank numbers (DTensor grad clipping, summed gradients) and DCP resharding on resume.
The SIGKILL and export tests run the real trainer (test_run_resume.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_procs import read_metrics, run_to_end, toy_command

from polyrl.core.tolerances import tolerance

pytestmark = pytest.mark.distributed

STEPS, SAVE_EVERY = 6, 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """An uninterrupted 1-process run."""
    run_dir = tmp_path_factory.mktemp("ref")
    run_to_end(toy_command(run_dir, STEPS, SAVE_EVERY))
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    return metrics


@pytest.fixture(scope="module")
def two_proc_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-process run of the first 4 steps (checkpoints at 2 and 4)."""
    run_dir = tmp_path_factory.mktemp("two")
    run_to_end(toy_command(run_dir, 4, SAVE_EVERY, nproc=2))
    return run_dir


def _assert_close(a: list[dict], b: list[dict]) -> None:
    tol = tolerance("distributed.loss", "float32")
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm"):
            assert abs(x[key] - y[key]) <= tol * abs(y[key]), (x["step"], key, x[key], y[key])


def test_two_processes_match_one_process(reference: list[dict], two_proc_dir: Path) -> None:
    two = read_metrics(two_proc_dir)
    _assert_close(two, reference[:4])
    assert sorted(p.name for p in (two_proc_dir / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    assert len(list((two_proc_dir / "checkpoints" / "step_00000004").glob("*.distcp"))) == 2  # one file per rank


def test_two_process_checkpoint_resumes_with_one_process(reference: list[dict], two_proc_dir: Path) -> None:
    run_to_end(toy_command(two_proc_dir, STEPS, SAVE_EVERY, nproc=1))
    _assert_close(read_metrics(two_proc_dir), reference)
