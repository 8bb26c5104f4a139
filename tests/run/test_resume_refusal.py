"""Issue 21 "done when", through ``polyrl run`` and ``polyrl export`` on the tiny GPT-OSS DAPO recipe (4 steps,
checkpoints at 2 and 4): each damage to the newest checkpoint (planted metadata pickle, planted extra-state
pickle, truncated shard, missing rank file, flipped byte in a shard) exits 2 with one line naming the file
and the earlier checkpoint that verifies, the payload never runs and the run directory is unchanged; then
resuming from the checkpoint the line names gives the metrics of the uninterrupted run."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from test_checkpoint_integrity import DAMAGE, tree

from polyrl.cli import main as polyrl_main
from polyrl.core.plugins.selection import reset_active_backend

SMALL = [
    "data.batch_size=4", "rollout.n=4", "algorithm.mini_batch_size=16", "algorithm.ppo_epochs=1",
    "algorithm.dynamic_sampling.enable=false", "trainer.num_threads=1", "trainer.save_every=2",
    "trainer.total_steps=4",
]  # fmt: skip


def polyrl(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    reset_active_backend()
    capsys.readouterr()
    rc = polyrl_main(list(args))
    return rc, capsys.readouterr().err


def run_args(out: Path, *extra: str) -> list[str]:
    return ["run", "gpt_oss_dapo_tiny.yaml", "--output", str(out), "--no-progress", *SMALL, *extra]


def metrics(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time/")} for x in lines]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 4-step run (in this process, like the resumes below)."""
    out = tmp_path_factory.mktemp("runs") / "done"
    reset_active_backend()
    assert polyrl_main(run_args(out)) == 0
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]
    assert {p.name for p in (out / "checkpoints").iterdir()} >= {"step_00000002", "step_00000004"}
    return out


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_is_refused_in_one_line(finished: Path, tmp_path: Path, capsys, case: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    name, damage = DAMAGE[case]
    witness = tmp_path / "payload-ran"
    bad = run / "checkpoints" / "step_00000004" / name
    damage(bad, witness)
    before = tree(run)
    rc, err = polyrl(capsys, *run_args(run))
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith(f"polyrl run: error: {bad}: "), err
    assert "the newest earlier checkpoint that verifies is step_00000002" in err
    assert "run the same command with --resume-from step_00000002" in err
    assert not witness.exists()
    assert tree(run) == before

    out = tmp_path / "hf"
    rc, err = polyrl(capsys, "export", str(run), str(out))
    assert rc == 2 and err.count("\n") == 1 and err.startswith(f"polyrl export: error: {bad}: "), err
    assert f"polyrl export {run / 'checkpoints' / 'step_00000002'} {out}" in err
    assert not witness.exists() and not out.exists() and tree(run) == before


def test_resuming_from_the_named_checkpoint_gives_the_uninterrupted_metrics(
        finished: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    name, damage = DAMAGE["flipped byte in a shard"]
    damage(run / "checkpoints" / "step_00000004" / name, tmp_path / "unused")
    rc, err = polyrl(capsys, *run_args(run))
    assert rc == 2
    named = re.search(r"--resume-from (step_\d+)", err).group(1)
    rc, err = polyrl(capsys, *run_args(run, "--resume-from", named))
    assert rc == 0, err
    assert "resuming" in err and "from step 2" in err
    assert metrics(run) == metrics(finished)  # steps 3 and 4 replayed: bit-identical on the CPU
    # The damaged checkpoint was set aside (kept), and step 4 written again by the resumed run with the
    # same state (.metadata and COMPLETE differ: they hold a save id and a time).
    assert len(list((run / "checkpoints").glob("superseded-*/step_00000004"))) == 1
    again, first = tree(run / "checkpoints" / "step_00000004"), tree(finished / "checkpoints" / "step_00000004")
    for name in ("__0_0.distcp", "extra/rank_0.pt"):
        assert again[name] == first[name], name
