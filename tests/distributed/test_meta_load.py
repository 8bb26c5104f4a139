"""Sharded load under several processes (gloo, 2 ranks): rank 0 builds the models, the other rank builds meta
skeletons and never holds a full copy, and after the load every parameter and buffer of the actor, the reference
model and the critic equals the single-process build on every rank — for both tiny recipes, with the experts split
(``sharding.expert_parallel=2``), and from checkpoints in the published MXFP4 / block-FP8 layouts. Training from
the sharded load gives exactly the metrics of training from every rank's own full build."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dist_procs import REPO, child_env

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("meta_load_worker.py")


def _run(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "load"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(POLYRL_DISABLE_PLUGIN_AUTOLOAD="1"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def test_rank0_builds_and_every_rank_gets_the_single_process_weights(tmp_path: Path) -> None:
    specs = ("deepseek_ppo_tiny", "gpt_oss_dapo_tiny", "gpt_oss_dapo_tiny:sharding.expert_parallel=2")
    ranks = _run(tmp_path, *specs)
    for rank, result in enumerate(ranks):
        for spec in specs:
            row = result[spec]
            calls = row["meta_before"]  # [real parameter elements, all] of each model before it was sharded
            assert calls, spec  # the sharded load ran
            if rank == 0:  # the actor and the critic are real; the reference is a meta copy of the actor
                assert [real == total for real, total in calls] == [True, False, True][:len(calls)], spec
            else:  # meta skeletons; only the critic's value head (H + 1 values) is real, drawn as in one process
                assert all(real <= total // 100 for real, total in calls), (spec, calls)
            for model in ("actor", "ref", "critic"):
                if model in row:
                    assert row[model]["buffers"] > 0, (rank, spec, model)  # rotary inv_freq (non-persistent)
                    assert row[model]["differ"] == [], (rank, spec, model)
    deepseek = ranks[1]["deepseek_ppo_tiny"]
    assert "ref" in deepseek and "critic" in deepseek and len(deepseek["meta_before"]) == 3
    assert ranks[0]["gpt_oss_dapo_tiny"]["meta_before"][0][0] > 0


def test_training_from_the_sharded_load_is_bit_identical(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "deepseek_ppo_tiny", "--steps", "2")
    runs = ranks[0]["deepseek_ppo_tiny"]["steps"]
    assert len(runs["rank0"]) == 2 and runs["rank0"][0]
    assert runs["rank0"] == runs["every_rank"]


def test_published_checkpoints_load_into_the_shards(tmp_path: Path) -> None:
    """The meta skeleton of a checkpoint directory (the dequantized architecture: no quantization block, the
    task's vocabulary) matches what rank 0 loads from the MXFP4 / block-FP8 files, and every rank ends with it."""
    from published_checkpoints import write_tiny

    specs = [f"{recipe}:model.name={write_tiny(tmp_path / arch, arch)['published']}"
             for recipe, arch in (("gpt_oss_dapo_tiny", "gpt_oss"), ("deepseek_ppo_tiny", "deepseek_v3"))]
    for rank, result in enumerate(_run(tmp_path, *specs)):
        for spec in specs:
            row = result[spec]
            assert row["meta_before"] and (rank == 0 or row["meta_before"][0][0] == 0), (rank, spec)
            for model in ("actor", "ref", "critic"):
                if model in row:
                    assert row[model]["differ"] == [], (rank, spec, model)
