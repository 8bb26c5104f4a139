"""Issue 6 "done when", on the real trainer: ``polyrl run`` of the tiny GPT-OSS DAPO recipe (scaled down
further so each run takes seconds), on 1 and 2 gloo processes, killed with SIGKILL and restarted with the
same command, resumed across process counts, and exported.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from dist_procs import child_env, read_metrics, run_and_kill, run_to_end

from polyrl.core.distributed.launch import worker_pids
from polyrl.core.run import checkpoint as C
from polyrl.core.tolerances import tolerance

pytestmark = pytest.mark.distributed

TOTAL, SAVE_EVERY = 6, 2
# A global batch of 4 prompts x 4 samples, one mini-batch (so its composition does not depend on how
# the rows are split over ranks), no dynamic sampling, one thread per process.
SMALL = [
    "data.batch_size=4", "rollout.n=4", "algorithm.mini_batch_size=16", "algorithm.ppo_epochs=1",
    "algorithm.dynamic_sampling.enable=false", "trainer.num_threads=1", f"trainer.save_every={SAVE_EVERY}",
]  # fmt: skip
# ppo_kl / clip fractions are ~0 on the first epoch (rounding noise only): not compared relatively.
COMPARED = ("reward/mean", "response/length_mean", "loss/policy", "loss/total", "actor/grad_norm", "actor/entropy",
            "advantages/abs_mean")


def run_cmd(out: Path, total: int = TOTAL, nproc: int = 1, extra: tuple[str, ...] = (),
            recipe: str = "gpt_oss_dapo_tiny") -> list[str]:
    return [sys.executable, "-m", "polyrl", "run", f"{recipe}.yaml", "--output", str(out), "--no-progress",
            "--nproc", str(nproc), f"trainer.total_steps={total}", *SMALL, *extra]  # fmt: skip


def without_time(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics]


def assert_close(a: list[dict], b: list[dict]) -> None:
    tol = tolerance("distributed.loss", "float32")
    assert [m["step"] for m in a] == [m["step"] for m in b]
    for x, y in zip(a, b):
        assert ("actor/entropy" in x) == ("actor/entropy" in y), x["step"]  # the drift check's steps agree
        for key in (k for k in COMPARED if k in y):  # actor/entropy: on the drift check's steps only
            assert abs(x[key] - y[key]) <= tol * max(abs(y[key]), 1e-3), (x["step"], key, x[key], y[key])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """An uninterrupted 1-process run of TOTAL steps."""
    out = tmp_path_factory.mktemp("ref")
    run_to_end(run_cmd(out))
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, TOTAL + 1))
    assert len({m["reward/mean"] for m in metrics}) > 1  # it is really sampling and learning
    return metrics


@pytest.fixture(scope="module")
def two_proc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 steps on 2 processes (checkpoints at 2 and at the end, 3), through the fused lm_head log-prob path
    (FSDP2 must regather the sharded lm_head weight for its backward): the reference takes the logits path."""
    out = tmp_path_factory.mktemp("two")
    run_to_end(run_cmd(out, total=3, nproc=2, extra=("model.fused_logprobs=true",)))
    return out


def test_two_processes_give_the_one_process_trajectory(reference: list[dict], two_proc: Path) -> None:
    assert_close(read_metrics(two_proc), reference[:3])
    assert len(list((two_proc / "checkpoints" / "step_00000003").glob("*.distcp"))) == 2


def test_two_processes_with_the_fused_loss_give_the_one_process_trajectory(reference: list[dict],
                                                                          tmp_path: Path) -> None:
    """``model.fused_loss``: the gradients computed inside the fused op's forward (the sharded lm_head weight's
    among them) reach FSDP2's reduce-scatter as the backward's would."""
    run_to_end(run_cmd(tmp_path, total=3, nproc=2, extra=("model.fused_logprobs=true", "model.fused_loss=true")))
    assert_close(read_metrics(tmp_path), reference[:3])


def test_two_process_checkpoint_resumes_with_one_process(reference: list[dict], two_proc: Path) -> None:
    run_to_end(run_cmd(two_proc, total=TOTAL, nproc=1))
    assert_close(read_metrics(two_proc), reference)


def test_sigkill_mid_step_then_same_command_is_identical(reference: list[dict], tmp_path: Path) -> None:
    cmd = run_cmd(tmp_path)
    metrics = tmp_path / "metrics.jsonl"

    def after_step_3() -> bool:  # step 3 logged: the kill lands inside step 4 (rollout or update)
        return metrics.exists() and len(metrics.read_text().splitlines()) >= 3

    run_and_kill(cmd, after_step_3, child_env())
    assert C.latest_checkpoint(tmp_path / "checkpoints").name == "step_00000002"
    run_to_end(cmd)
    assert without_time(read_metrics(tmp_path)) == without_time(reference)  # bit-identical


def test_sigkill_while_writing_a_checkpoint_never_loads_it(reference: list[dict], tmp_path: Path) -> None:
    cmd = run_cmd(tmp_path)
    partial = tmp_path / "checkpoints" / "step_00000004.tmp"
    env = child_env(POLYRL_TEST_CHECKPOINT_DELAY_S="60", POLYRL_TEST_CHECKPOINT_DELAY_STEP="4")
    run_and_kill(cmd, lambda: (partial / "extra" / "rank_0.pt").exists(), env)
    assert partial.is_dir() and not (tmp_path / "checkpoints" / "step_00000004").exists()
    assert C.latest_checkpoint(tmp_path / "checkpoints").name == "step_00000002"
    run_to_end(cmd)
    assert without_time(read_metrics(tmp_path)) == without_time(reference)
    assert not partial.exists()


def test_exported_model_gives_the_trainers_logits(reference: list[dict], two_proc: Path, tmp_path: Path) -> None:
    """Export the final checkpoint of a run; its logits equal the trainer's model loaded from the same
    checkpoint (polyrl attention in the trainer, transformers' default after from_pretrained)."""
    from transformers import AutoModelForCausalLM

    from polyrl.cli import main as cli_main
    from polyrl.core.models import build_model

    assert cli_main(["export", str(two_proc), str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    trainer_model = build_model("gpt_oss_tiny", vocab_size=exported.config.vocab_size).eval()
    C.load_model_weights(C.latest_checkpoint(two_proc / "checkpoints"), trainer_model)
    ids = torch.arange(3, 15).remainder(exported.config.vocab_size).reshape(2, 6)
    with torch.no_grad():
        expected, got = trainer_model(ids).logits, exported(ids).logits
    err = ((got - expected).norm() / expected.norm()).item()
    assert err <= tolerance("model.logits", "float32"), err
    assert not torch.equal(expected, build_model("gpt_oss_tiny", vocab_size=exported.config.vocab_size)(ids).logits)


def test_ppo_with_critic_and_reference_on_two_processes_matches_one(tmp_path: Path) -> None:
    """DeepSeek-V3 tiny PPO: actor, frozen reference and critic all sharded; GAE whitening is global."""

    def cmd(out: Path, nproc: int) -> list[str]:
        return [sys.executable, "-m", "polyrl", "run", "deepseek_ppo_tiny.yaml", "--output", str(out), "--no-progress",
                "--nproc", str(nproc), "trainer.total_steps=2", *SMALL]  # fmt: skip

    run_to_end(cmd(tmp_path / "one", 1))
    run_to_end(cmd(tmp_path / "two", 2))
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    tol = tolerance("distributed.loss", "float32")
    for x, y in zip(two, one):
        for key in ("reward/mean", "actor/grad_norm", "critic/grad_norm", "loss/value"):
            assert abs(x[key] - y[key]) <= tol * abs(y[key]), (x["step"], key, x[key], y[key])
    assert len(two) == len(one) == 2


@pytest.mark.parametrize("recipe", ["gpt_oss_dapo_tiny", "deepseek_ppo_tiny"])
def test_the_tiny_recipes_train_in_bfloat16_on_two_processes(recipe: str, tmp_path: Path) -> None:
    """Sharded in bf16 (the full recipes' dtype): FSDP2 needs one dtype per model, the critic's value head
    included; the final checkpoint checks every rank's shards finite, empty ones included."""
    run_to_end(run_cmd(tmp_path, total=2, nproc=2, extra=("model.dtype=bfloat16",), recipe=recipe))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(v) for r in rows for v in r.values()), rows
    assert (tmp_path / "checkpoints" / "step_00000002" / "COMPLETE").exists()


def test_dynamic_sampling_on_two_processes_matches_one(tmp_path: Path) -> None:
    """DAPO's group filter decides over the global batch (gathered from every rank), so with dynamic
    sampling on, 2 processes keep the same groups, use the same generation batches and train the same."""
    ds = [a for a in SMALL if "dynamic_sampling" not in a] + [
        "algorithm.dynamic_sampling.enable=true", "algorithm.dynamic_sampling.metric=score",
        "algorithm.dynamic_sampling.max_num_gen_batches=0",
    ]  # fmt: skip
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"ds{nproc}"
        cmd = [sys.executable, "-m", "polyrl", "run", "gpt_oss_dapo_tiny.yaml", "--output", str(out), "--no-progress",
               "--nproc", str(nproc), "trainer.total_steps=3", *ds]  # fmt: skip
        run_to_end(cmd)
        runs[nproc] = read_metrics(out)
    assert_close(runs[2], runs[1])
    for a, b in zip(runs[2], runs[1]):
        for key in ("dapo/gen_batches", "dapo/groups_filtered", "dapo/groups_kept", "reward/errors"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    # the filter really acted (step 3 of this seed regenerates after dropping uniform groups)
    assert sum(m["dapo/groups_filtered"] for m in runs[1]) > 0 and max(m["dapo/gen_batches"] for m in runs[1]) > 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads worker environments from /proc")
def test_a_worker_killed_mid_step_stops_every_rank_with_one_line_each_then_resumes(
    reference: list[dict], tmp_path: Path
) -> None:
    import signal
    import subprocess
    import time

    from dist_procs import child_env as env_of

    cmd = run_cmd(tmp_path, nproc=2)
    proc = subprocess.Popen(cmd, env=env_of(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 150
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # the kill lands inside step 4
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "step 3 never logged"
        time.sleep(0.05)
    pids = worker_pids(proc.pid)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[1], signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=60)  # torchrun's own shutdown timeout is 30 s, NCCL's minutes
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("polyrl run:")]
    assert f"polyrl run: [rank 0] rank 1 (pid {pids[1]}) ended in the middle of the run; this rank stops too" in lines
    assert f"polyrl run: rank 1 (pid {pids[1]}) was killed by SIGKILL; every rank has stopped" in lines
    assert lines[-1] == "polyrl run: the same command resumes from step 2", lines
    assert "Traceback" not in err, err[-3000:]
    run_to_end(cmd)
    assert_close(read_metrics(tmp_path), reference)
