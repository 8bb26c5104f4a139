"""The run's guard alone: the stages it tracks, and what an exception leaving the run becomes (the lines the user
reads; the end-to-end faults are tests/trainer/test_faults.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from polyrl.core.config import load_config
from polyrl.core.run.guard import RunGuard
from polyrl.core.run.outcome import RunFault, RunStopped, TrainingAborted


@pytest.fixture
def guard() -> RunGuard:
    cfg = load_config("recipes/gpt_oss_dapo_tiny.yaml", ["algorithm.micro_batch_tokens=4096"])
    steps = SimpleNamespace(done=6)
    plan = SimpleNamespace(phases={"rollout": 0.5, "update": 1.25}, usable_gib=12.0)
    return RunGuard(cfg, step=lambda: steps.done, plan=lambda: plan)


def test_the_phase_is_the_stage_of_the_step_being_run(guard: RunGuard) -> None:
    assert guard.phase is None
    with guard.stage("step"):
        assert guard.phase is None
        with guard.stage("rollout"):
            assert guard.phase == "rollout"
        with guard.stage("update"):
            assert guard.phase == "update"
        assert guard.phase is None
    with pytest.raises(ValueError, match="unknown stage 'rolout'"), guard.stage("rolout"):
        pass


def test_device_memory_names_the_stage_the_step_the_key_and_the_plan(guard: RunGuard, tmp_path: Path) -> None:
    with pytest.raises(RunFault) as caught, guard.run(tmp_path / "checkpoints"), guard.stage("step"):
        with guard.stage("rollout"):
            pass
        with guard.stage("update"):
            raise torch.OutOfMemoryError("out of memory (injected)")
    assert str(caught.value) == (
        "device out of memory in the update at step 7 (algorithm.micro_batch_tokens=4096; the dry-run plan predicted "
        "a peak of 1.25 GiB in the update, 12.0 GiB usable); lower algorithm.micro_batch_tokens (e.g. 2048) or set "
        "trainer.activation_checkpointing=true and rerun: the same command starts over (no checkpoint yet)")
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)


def test_a_disk_fault_names_what_the_run_was_writing(guard: RunGuard, tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(RunFault) as caught, guard.run(checkpoints), guard.stage("saving", where=checkpoints):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a failed write names no file
    assert str(caught.value) == (f"no space left on {tmp_path / 'checkpoints'} while saving step 6; free space and "
                                 "rerun: the same command starts over (no checkpoint yet)")


def test_a_stop_signal_is_a_stop_and_anything_else_leaves_as_itself(guard: RunGuard, tmp_path: Path) -> None:
    with pytest.raises(RunStopped) as stopped, guard.run(tmp_path), guard.stage("step"):
        raise KeyboardInterrupt
    assert (stopped.value.signum, stopped.value.message) == (
        2, "stopped by SIGINT at step 6; the same command starts over (no checkpoint yet)")
    bug, aborted = ValueError("a bug"), TrainingAborted("non-finite updates in a row")
    for exc in (bug, aborted):
        with pytest.raises(type(exc)) as caught, guard.run(tmp_path), guard.stage("step"), guard.stage("update"):
            raise exc
        assert caught.value is exc  # not reworded, traceback kept
