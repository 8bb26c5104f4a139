"""The checkpoint protocol end to end on a toy FSDP2 loop (tests/distributed/toy_worker.py).

Kills are real SIGKILLs of the whole process group; "identical" means bit-identical per-step metrics on
CPU with the same process count, and within the fp32 table tolerance across process counts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_procs import child_env, read_metrics, run_and_kill, run_to_end, toy_command

from polyrl.core import checkpoint as C
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


def test_sigkill_mid_step_then_same_command_is_identical(reference: list[dict], tmp_path: Path) -> None:
    cmd = toy_command(tmp_path, STEPS, SAVE_EVERY)
    metrics = tmp_path / "metrics.jsonl"

    def in_step_4() -> bool:  # step 3 logged, step 4 sleeping between backward and optimizer step
        return metrics.exists() and len(metrics.read_text().splitlines()) >= 3

    run_and_kill(cmd, in_step_4, child_env(TOY_STEP_SLEEP_S="0.3"))
    assert C.latest_checkpoint(tmp_path / "checkpoints").name == "step_00000002"
    run_to_end(cmd)
    assert read_metrics(tmp_path) == reference  # bit-identical


def test_sigkill_while_checkpoint_is_written_never_loads_partial(reference: list[dict], tmp_path: Path) -> None:
    cmd = toy_command(tmp_path, STEPS, SAVE_EVERY)
    partial = tmp_path / "checkpoints" / "step_00000004.tmp"

    def writing_step_4() -> bool:  # every file written, publication not yet done
        return (partial / "extra" / "rank_0.pt").exists()

    env = child_env(POLYRL_TEST_CHECKPOINT_DELAY_S="60", POLYRL_TEST_CHECKPOINT_DELAY_STEP="4")
    run_and_kill(cmd, writing_step_4, env)
    assert partial.is_dir() and not (tmp_path / "checkpoints" / "step_00000004").exists()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert C.latest_checkpoint(tmp_path / "checkpoints").name == "step_00000002"
    run_to_end(cmd)
    assert read_metrics(tmp_path) == reference
    assert not partial.exists()  # cleaned up by the next save of that step


def test_sharded_gpt_oss_matches_one_process_and_exports_its_logits(tmp_path: Path) -> None:
    """Tiny GPT-OSS (MoE, sinks) under FSDP2 on 2 ranks: same losses as 1 process; the export of the
    2-rank checkpoint, loaded with from_pretrained, gives the trainer's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from polyrl.cli import main as cli_main

    env = child_env(TOY_MODEL="gpt_oss_tiny")
    one, two = tmp_path / "one", tmp_path / "two"
    run_to_end(toy_command(one, 2, 2), env)
    run_to_end(toy_command(two, 2, 2, nproc=2), env)
    _assert_close(read_metrics(two), read_metrics(one))
    assert cli_main(["export", str(two), str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    trainer_logits = torch.load(two / "probe_logits.pt", weights_only=True)
    with torch.no_grad():
        exported = model(torch.arange(12).remainder(model.config.vocab_size).reshape(2, 6)).logits
    # The trainer runs attn_implementation="polyrl", from_pretrained the default eager one.
    err = (exported - trainer_logits).norm() / trainer_logits.norm()
    assert err <= tolerance("model.logits", "float32"), err
