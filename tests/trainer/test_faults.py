"""Faults of the machine in the middle of ``polyrl run``, each injected on the CPU: the run ends with exit 1 and one
line (the cause, what to do, the step the same command resumes from; no traceback), the run directory stays
resumable, and the same command then completes the run with each step once in ``metrics.jsonl``.

Disk faults use a real small file system where the suite can mount one (root), else an ``OSError`` injected
where the writer meets it (``fault_injection``). The metrics and events writers always get the injected error:
on a real full disk which of the run's files meets it first depends on page boundaries, not on the test.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fault_injection import MIB, FailsAt, no_space, read_only, small_fs

from polyrl.core.rollout.hf import HFEngine
from polyrl.core.run import integrity as I
from polyrl.core.run.checkpoint import save as checkpoint_save
from polyrl.core.run.directory import RunDir
from polyrl.core.tasks.synthetic import SyntheticTask
from polyrl.core.trainer import update as U
from polyrl.core.trainer.loop import Trainer

TINY = ["data.batch_size=4", "trainer.save_every=1", "trainer.num_threads=1"]


def _args(out: Path, steps: int = 2, *extra: str) -> list[str]:
    return ["gpt_oss_dapo_tiny", "--output", str(out), f"trainer.total_steps={steps}", *TINY, *extra]


def _fault(err: str, pattern: str) -> str:
    """The run's one fault line (the last line, after the run log), matching ``pattern``; no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    said = [line for line in lines if line.startswith("polyrl run: error:")]
    assert len(said) == 1 and said[0] == lines[-1], err
    assert re.fullmatch("polyrl run: error: " + pattern, said[0]), said[0]
    return said[0]


def _completes(run_cli, read_metrics, out: Path, resumed: int, steps: int = 2, extra: tuple[str, ...] = ()) -> None:
    """The same command, fault gone: it resumes where the line said and writes each step once."""
    rc, _, err = run_cli(_args(out, steps, *extra))
    assert rc == 0, err
    assert f"resuming {out} from step {resumed}" in err
    assert [r["step"] for r in read_metrics(out)] == list(range(1, steps + 1))


def _before_step(m: pytest.MonkeyPatch, step: int, action: Callable[[], None]) -> None:
    """Run ``action`` just before ``Trainer.step`` runs step ``step`` (a fault arriving mid-run)."""
    real = Trainer.step

    def step_with_fault(self: Trainer) -> dict[str, float]:
        if self.state.step == step - 1:
            action()
        return real(self)

    m.setattr(Trainer, "step", step_with_fault)


# --- the disk ----------------------------------------------------------------------------------------------------
def test_a_checkpoint_that_cannot_fit_is_refused_before_anything_is_written(
    tmp_path: Path, run_cli, read_metrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's run: a small file system fills at a checkpoint. The save sees it first (the previous save's
    size is known), says so, and writes nothing."""
    with small_fs(tmp_path / "fs", 3) as fs:  # one tiny checkpoint (~2 MiB) fits, two do not
        out = tmp_path / "fs" / "run"
        with monkeypatch.context() as m:
            if fs is None:  # the file system reports half a MiB free once the first checkpoint is there
                real = checkpoint_save.free_bytes
                m.setattr(checkpoint_save, "free_bytes", lambda p: MIB // 2 if (Path(p) / "step_00000001").exists() else real(p))
            rc, _, err = run_cli(_args(out))
        assert rc == 1
        _fault(err, rf"not enough space on {out}/checkpoints for checkpoint step 2 \(needs ~[12]\.\d MiB, "
                    r"0\.\d MiB free\); nothing was written; free space and rerun: the same command resumes from step 1")
        assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000001"]
        if fs is not None:
            fs.resize(16)
        _completes(run_cli, read_metrics, out, resumed=1)


def test_a_disk_that_fills_while_a_checkpoint_is_written(
    tmp_path: Path, run_cli, read_metrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Space taken after the save's check (another process): DCP's writer fails mid-file (torch's zip writer
    wraps the ENOSPC, DCP wraps that); the partial directory is removed, the earlier checkpoint stays."""
    with small_fs(tmp_path / "fs", 8) as fs:
        out = tmp_path / "fs" / "run"
        with monkeypatch.context() as m:
            real = checkpoint_save._write_and_publish

            def filling(root, tmp, final, step, *args):
                if step == 2 and fs is not None:
                    fs.fill(leave=256 * 1024)
                elif step == 2:
                    m.setattr(I._HashingStream, "write", lambda self, data: (_ for _ in ()).throw(no_space()))
                return real(root, tmp, final, step, *args)

            m.setattr(checkpoint_save, "_write_and_publish", filling)
            rc, _, err = run_cli(_args(out))
        assert rc == 1
        _fault(err, rf"no space left on {out}/checkpoints while writing checkpoint step 2 \(needs ~[12]\.\d MiB, "
                    r"\d+\.\d MiB free\); free space and rerun: the same command resumes from step 1")
        assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000001"]  # no .tmp left
        if fs is not None:
            (fs.path / "filler").unlink()
        _completes(run_cli, read_metrics, out, resumed=1)


@pytest.mark.parametrize("target", ["metrics.jsonl", "events"])
def test_a_full_disk_under_the_metrics_or_the_events(
    target: str, tmp_path: Path, run_cli, read_metrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorboard.summary.writer.record_writer import RecordWriter

    out = tmp_path / "run"
    with monkeypatch.context() as m:
        real = RunDir.open

        def open_then_fill(self: RunDir, *args, **kwargs) -> RunDir:
            real(self, *args, **kwargs)
            if target == "metrics.jsonl":
                self._metrics_f = FailsAt(self._metrics_f, 2)  # step 2's line
            else:
                self._tb._records = RecordWriter(FailsAt(self._tb._file, 2))  # step 2's event
            return self

        m.setattr(RunDir, "open", open_then_fill)
        rc, _, err = run_cli(_args(out))
    assert rc == 1
    _fault(err, rf"no space left on {out}/{target} while logging step 2; free space and rerun: "
                r"the same command resumes from step 1")
    _completes(run_cli, read_metrics, out, resumed=1)


def test_a_run_directory_that_turns_read_only(
    tmp_path: Path, run_cli, read_metrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    with contextlib.ExitStack() as stack, monkeypatch.context() as m:
        how: list[str | None] = []

        def lock_checkpoints() -> None:
            how.append(stack.enter_context(read_only(out / "checkpoints")))
            if how[-1] is None:  # root without mount: inject what the kernel would say
                path = out / "checkpoints" / "step_00000002.tmp"
                m.setattr(checkpoint_save, "hashing_storage_writer",
                          lambda p: (_ for _ in ()).throw(OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))))

        _before_step(m, 2, lock_checkpoints)
        rc, _, err = run_cli(_args(out))
    assert rc == 1
    cause = (r"permission denied on \S+" if how == ["EACCES"]
             else rf"{out}/checkpoints/step_00000002\.tmp\S* is on a read-only file system")
    _fault(err, rf"{cause} while saving step 2; make it writable and rerun: the same command resumes from step 1")
    _completes(run_cli, read_metrics, out, resumed=1)


# --- the rollout engine and device memory ----------------------------------------------------------------------
def test_the_rollout_engine_raising_mid_generation(
    tmp_path: Path, run_cli, read_metrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"

    def broken(self, *args, **kwargs):
        raise RuntimeError("engine core died\n(pages of the engine's own log)")

    with monkeypatch.context() as m:
        _before_step(m, 2, lambda: m.setattr(HFEngine, "generate", broken))
        rc, _, err = run_cli(_args(out))
    assert rc == 1
    _fault(err, r"the rollout engine hf failed at step 2 \(RuntimeError: engine core died\); fix the cause shown "
                r"and rerun: the same command resumes from step 1")
    _completes(run_cli, read_metrics, out, resumed=1)


def _oom(*args, **kwargs):
    raise torch.OutOfMemoryError("out of memory (injected)")


@pytest.mark.parametrize("phase", ["rollout", "update"])
def test_device_out_of_memory_names_the_phase_the_key_and_the_plan(
    phase: str, tmp_path: Path, run_cli, read_metrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        if phase == "rollout":  # the hf engine's forward is the trainer's model
            _before_step(m, 2, lambda: m.setattr(HFEngine, "generate", _oom))
        else:
            _before_step(m, 2, lambda: m.setattr(U, "policy_forward", _oom))
        rc, _, err = run_cli(_args(out))
    assert rc == 1
    plan = r"the dry-run plan predicted a peak of \d+\.\d\d GiB in the {0}, \d+\.\d GiB usable"
    if phase == "rollout":  # 4 prompts x 8 samples, all at once
        _fault(err, r"device out of memory in the rollout at step 2 \(rollout\.micro_batch_size=0: 32 sequences "
                    rf"generated together; {plan.format('rollout')}\); set rollout\.micro_batch_size lower "
                    r"\(e\.g\. 16\) and rerun: the same command resumes from step 1")
    else:
        _fault(err, rf"device out of memory in the update at step 2 \(algorithm\.micro_batch_tokens=4096; "
                    rf"{plan.format('update')}\); lower algorithm\.micro_batch_tokens \(e\.g\. 2048\) or set "
                    r"trainer\.activation_checkpointing=true and rerun: the same command resumes from step 1")
    _completes(run_cli, read_metrics, out, resumed=1)


# --- reward workers --------------------------------------------------------------------------------------------
def segfaulting_reward(answer: str, response: str) -> float:
    """A verifier that crashes its process (what a segfault in C code does), without leaving a core file."""
    import faulthandler
    import resource
    import signal

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    faulthandler.disable()  # pytest's: its dump of the dying worker is not what the test looks at
    os.kill(os.getpid(), signal.SIGSEGV)
    return 0.0


def test_reward_workers_that_die_are_counted_then_stop_the_run(
    tmp_path: Path, run_cli, read_metrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From step 2 on every reward kills its worker: step 2 still trains (each reward scored as the task's failure
    value, counted in reward/errors); the second such batch in a row (data.reward_max_failures_in_row=2) stops
    the run at step 3."""
    out = tmp_path / "run"
    extra = ("algorithm.dynamic_sampling.enable=false", "data.reward_max_failures_in_row=2")
    with monkeypatch.context() as m:
        _before_step(m, 2, lambda: m.setattr(SyntheticTask, "remote_score", staticmethod(segfaulting_reward),
                                             raising=False))
        rc, _, err = run_cli(_args(out, 3, *extra))
    assert rc == 1
    _fault(err, r"every reward failed in 2 generation batches in a row at step 3 \(the last: reward worker killed by "
                r"SIGSEGV\); fix the reward function \(or raise data\.reward_max_failures_in_row, 0 never stops\) "
                r"and rerun: the same command resumes from step 2")
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward/errors"] == 0 and rows[1]["reward/errors"] == 32 and rows[1]["reward/min"] == 0.0
    assert rows[1]["reward/max"] == 0.0  # every one scored the failure value (0 for synthetic tasks)
    _completes(run_cli, read_metrics, out, resumed=2, steps=3, extra=extra)
