"""Shortened ``polyrl run`` of both tiny recipes: the metrics file, the run directory, seeds, resume, NaNs; and the
run directory on its own (the lock of a live run, the history cut back on resume)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from polyrl.core import algorithms as A
from polyrl.core.config import load_config
from polyrl.core.run.directory import LOCK_FILE, RunDir, RunDirLocked, RunLock, check_unlocked

COMMON = [
    "step",
    "reward/mean",
    "loss/policy",
    "time/step_s",
    "actor/grad_norm",
    "actor/lr",
    "response/length_mean",
    "actor/pg_clipfrac",
    "train/nonfinite_skipped",
]
DAPO = [
    "dapo/groups_filtered",
    "dapo/gen_batches",
    "dapo/overlong_penalized",
    "actor/clipfrac_low",
    "actor/clipfrac_high",
]
PPO = ["loss/value", "critic/vf_clipfrac", "kl/reward_kl", "kl/coef", "critic/explained_var"]


@pytest.mark.parametrize(("recipe", "extra"), [("gpt_oss_dapo_tiny", DAPO), ("deepseek_ppo_tiny", PPO)])
def test_short_run_writes_the_run_directory(
    recipe: str, extra: list[str], tmp_path: Path, run_cli, read_metrics
) -> None:
    out = tmp_path / "run"
    rc, _, err = run_cli(
        [f"recipes/{recipe}.yaml", "--output", str(out), "--seed", "0", "trainer.total_steps=3", "data.batch_size=8"]
    )
    assert rc == 0, err
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in COMMON + extra:
        assert all(key in r for r in rows), key
        assert all(isinstance(r[key], (int, float)) and math.isfinite(r[key]) for r in rows), key
    # π_old is the hf engine's log-probs (algorithm.old_logprobs auto); the trainer's forward runs as the drift check
    # on step 1 and then every 10 steps: only those rows have its metrics
    checked = ("rollout/logprob_diff", "actor/entropy", "mismatch/k3")
    assert all(math.isfinite(rows[0][k]) for k in checked)
    assert not any(k in r for r in rows[1:] for k in checked)
    # sampling logprobs from the engine agree with the trainer's recompute (same weights, fp32)
    assert rows[0]["rollout/logprob_diff"] < 1e-4
    assert 0.0 <= rows[0]["reward/mean"] <= 1.0
    # the written config is the fully resolved one, and loads back to the same config
    written = load_config(out / "config.yaml")
    assert written == load_config(
        f"recipes/{recipe}.yaml", ["trainer.total_steps=3", "data.batch_size=8", "trainer.seed=0", "backend.name=cpu"]
    )
    assert "extends" not in yaml.safe_load((out / "config.yaml").read_text())
    assert any((out / "events").iterdir())  # TensorBoard events
    assert (out / "checkpoints" / "step_00000003" / "COMPLETE").exists()  # the final model
    assert "done:" in err


# The full recipes train in bf16: their tiny versions in that dtype, a few small steps (2 processes:
# tests/distributed/test_run_resume.py).
BF16 = ["model.dtype=bfloat16", "trainer.total_steps=2", "data.batch_size=4", "rollout.n=4",
        "algorithm.mini_batch_size=16", "algorithm.ppo_epochs=1", "trainer.num_threads=1"]


@pytest.mark.parametrize("recipe", ["gpt_oss_dapo_tiny", "deepseek_ppo_tiny"])
def test_the_tiny_recipes_train_in_bfloat16(recipe: str, tmp_path: Path, run_cli, read_metrics) -> None:
    out = tmp_path / "run"
    rc, _, err = run_cli([recipe, "--output", str(out), *BF16])
    assert rc == 0, err
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(v) for r in rows for v in r.values()), rows
    model = "critic" if recipe == "deepseek_ppo_tiny" else "actor"  # the critic's value head in bf16 too
    assert all(r[f"{model}/grad_norm"] > 0 for r in rows)


def test_dapo_counts_overlong_and_filters_groups(tmp_path: Path, run_cli, read_metrics) -> None:
    out = tmp_path / "run"
    # max 5 tokens with a 4-token buffer: almost every random response is penalised
    rc, _, err = run_cli(
        [
            "gpt_oss_dapo_tiny",
            "--output",
            str(out),
            "trainer.total_steps=2",
            "data.batch_size=8",
            "rollout.max_response_length=5",
            "algorithm.overlong.buffer_length=4",
            "algorithm.dynamic_sampling.metric=acc",
        ]
    )
    assert rc == 0, err
    rows = read_metrics(out)
    assert all(r["dapo/overlong_penalized"] > 0 for r in rows)
    # by exact-match accuracy a random policy's groups are all-wrong: filtered, regenerated up to the bound
    assert all(r["dapo/groups_filtered"] > 0 and r["dapo/gen_batches"] == 3 for r in rows)


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _run_processes(runs: list[tuple[Path, int]]) -> list[list[dict]]:
    """Real `polyrl run` processes (fresh interpreters: nothing shared with the test process), all at once:
    on 2 cores each loads the machine for the others, so their threads are scheduled differently."""
    env = dict(os.environ, POLYRL_DISABLE_PLUGIN_AUTOLOAD="1")
    procs = [subprocess.Popen([sys.executable, "-m", "polyrl", "run", "gpt_oss_dapo_tiny", "--seed", str(seed),
                               "--output", str(out), "--no-progress", "trainer.total_steps=3", "data.batch_size=8"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for out, seed in runs]
    try:
        errs = [p.communicate(timeout=600)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err
    return [_comparable([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
            for out, _ in runs]


@pytest.mark.slow
def test_same_seed_same_run_and_other_seed_differs(tmp_path: Path) -> None:
    """The recipe's 2 threads and a batch whose MoE backward takes torch's multi-threaded index_put path:
    identical only with deterministic algorithms, whatever the load (two same-seed runs at once)."""
    a, b, c = _run_processes([(tmp_path / "a", 3), (tmp_path / "b", 3), (tmp_path / "c", 4)])
    assert a == b
    assert a != c


def test_sigint_stops_a_run_cleanly_and_releases_its_directory(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) of a single-process run: it stops where it is, says so on one line (no traceback),
    exits 130, leaves only complete checkpoints, and frees the directory for the same command."""
    import signal
    import time

    out = tmp_path / "run"
    env = dict(os.environ, POLYRL_DISABLE_PLUGIN_AUTOLOAD="1")
    cmd = [sys.executable, "-m", "polyrl", "run", "gpt_oss_dapo_tiny", "--output", str(out), "--no-progress",
           "trainer.total_steps=50", "data.batch_size=8", "trainer.save_every=1", "trainer.num_threads=1"]
    # As from a terminal: a shell running this suite in the background (`cmd &`, nohup) hands its children
    # SIGINT ignored, and polyrl deliberately keeps an ignored signal ignored.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 180
        while not ((out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "no step 2"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    lines = [line for line in err.splitlines() if line.startswith("polyrl run:")]
    assert lines[0].startswith("polyrl run: backend cpu")  # the run log's first line names the backend
    assert lines[1].startswith("polyrl run: rollout engine hf")  # then the engine and why
    assert lines[2].startswith("polyrl run: rollout correction off")  # then whether the correction is on, and why
    assert lines[3].startswith("polyrl run: old log-probs from the engine")  # then where π_old comes from
    assert "Traceback" not in err and len(lines) == 5 and "stopped by SIGINT at step" in lines[4], err
    assert "the same command resumes from step" in lines[4]
    assert all((p / "COMPLETE").exists() for p in (out / "checkpoints").glob("step_????????"))
    check_unlocked(out)  # the lock went with the process


def test_resume_continues_exactly(tmp_path: Path, run_cli, read_metrics) -> None:
    args = ["deepseek_ppo_tiny", "--seed", "1", "data.batch_size=16", "trainer.save_every=1"]
    rc, _, err = run_cli([*args, "--output", str(tmp_path / "straight"), "trainer.total_steps=3"])
    assert rc == 0, err
    rc, _, err = run_cli([*args, "--output", str(tmp_path / "split"), "trainer.total_steps=2"])
    assert rc == 0, err
    rc, _, err = run_cli([*args, "--output", str(tmp_path / "split"), "trainer.total_steps=3"])
    assert rc == 0, err
    assert "resuming" in err and "from step 2" in err
    straight, split = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in split] == [1, 2, 3]
    assert _comparable(split) == _comparable(straight)  # bit-identical: deterministic algorithms, fixed threads


def _nan_policy_loss(calls_to_poison: set[int]):
    real = A.policy_loss
    count = {"n": 0}

    def poisoned(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        count["n"] += 1
        if count["n"] in calls_to_poison:
            loss = loss * float("nan")
        return loss, metrics

    return poisoned


def test_a_non_finite_update_is_skipped_and_counted(tmp_path: Path, run_cli, read_metrics, monkeypatch) -> None:
    monkeypatch.setattr(A, "policy_loss", _nan_policy_loss({1}))
    out = tmp_path / "run"
    rc, _, err = run_cli(["gpt_oss_dapo_tiny", "--output", str(out), "trainer.total_steps=2", "data.batch_size=8"])
    assert rc == 0, err
    rows = read_metrics(out)
    assert rows[-1]["train/nonfinite_skipped"] == 1
    assert (out / "checkpoints" / "step_00000002" / "COMPLETE").exists()


def test_a_resumed_run_counts_its_non_finite_updates_on(tmp_path: Path, run_cli, read_metrics, monkeypatch) -> None:
    """The counters a checkpoint holds are the ones the resumed run counts on: one skip before the checkpoint and one
    after the resume make 2 (they froze at the checkpoint's 1 when the load replaced the counters' object)."""
    out = tmp_path / "run"
    args = ["gpt_oss_dapo_tiny", "--output", str(out), "data.batch_size=8", "trainer.save_every=1"]
    monkeypatch.setattr(A, "policy_loss", _nan_policy_loss({1}))
    rc, _, err = run_cli([*args, "trainer.total_steps=1"])
    assert rc == 0, err
    monkeypatch.setattr(A, "policy_loss", _nan_policy_loss({1}))  # the first update after the resume
    rc, _, err = run_cli([*args, "trainer.total_steps=2"])
    assert rc == 0, err
    assert f"resuming {out} from step 1" in err
    assert [r["train/nonfinite_skipped"] for r in read_metrics(out)] == [1, 2]


def test_non_finite_updates_in_a_row_abort_without_a_checkpoint(
    tmp_path: Path, run_cli, read_metrics, monkeypatch
) -> None:
    monkeypatch.setattr(A, "policy_loss", _nan_policy_loss(set(range(1, 100))))
    out = tmp_path / "run"
    rc, _, err = run_cli(
        [
            "gpt_oss_dapo_tiny",
            "--output",
            str(out),
            "trainer.total_steps=3",
            "data.batch_size=8",
            "trainer.max_nonfinite_in_row=2",
        ]
    )
    assert rc == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("polyrl run: backend cpu (polyrl ")  # the run log names its backend first
    assert lines[1].startswith("polyrl run: rollout engine hf")  # then the engine and why
    assert lines[2].startswith("polyrl run: rollout correction off")
    assert lines[3].startswith("polyrl run: old log-probs from the engine")
    assert len(lines) == 5 and "not finite" in lines[4] and "in a row" in lines[4]
    assert "Traceback" not in err
    assert not any((out / "checkpoints").glob("step_*"))


def test_weights_never_checkpointed_when_not_finite(tmp_path: Path, run_cli, read_metrics, monkeypatch) -> None:
    from polyrl.core.trainer.loop import Trainer

    monkeypatch.setattr(Trainer, "weights_finite", lambda self: False)
    out = tmp_path / "run"
    rc, _, err = run_cli(["gpt_oss_dapo_tiny", "--output", str(out), "trainer.total_steps=1", "data.batch_size=8"])
    assert rc == 0
    assert "not finite; checkpoint not written" in err
    assert not any((out / "checkpoints").glob("step_*"))


def test_dry_run_prints_the_config_and_writes_nothing(tmp_path: Path, run_cli, read_metrics) -> None:
    out = tmp_path / "run"
    rc, stdout, err = run_cli(["deepseek_ppo_tiny", "--dry-run", "--output", str(out), "optimizer.lr=2e-4"])
    assert rc == 0, err
    assert yaml.safe_load(stdout)["optimizer"]["lr"] == 2e-4
    assert not out.exists()


def test_metrics_are_json_lines(tmp_path: Path, run_cli, read_metrics) -> None:
    out = tmp_path / "run"
    rc, _, _ = run_cli(["gpt_oss_dapo_tiny", "--output", str(out), "trainer.total_steps=2", "data.batch_size=8"])
    assert rc == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # every line is one JSON object ...
    assert len(rows) == 2 and all(isinstance(r, dict) for r in rows)  # ... one per step, none missing
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the keys every consumer (report, TensorBoard, users' scripts) relies on, as finite numbers
        for key in ("step", "reward/mean", "loss/policy", "time/step_s"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r.get(key))


# --- the run directory on its own ------------------------------------------------------------------------
def test_one_lock_per_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    check_unlocked(run)  # nothing there: free, and nothing is created
    assert not run.exists()
    lock = RunLock.acquire(run)
    assert lock.held and json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    before = (run / LOCK_FILE).stat().st_mtime_ns
    # flock locks belong to open file descriptions: a second acquire in this same process is refused too
    with pytest.raises(RunDirLocked, match=rf"in use by a live run \(pid {os.getpid()} on host {socket.gethostname()}"):
        RunLock.acquire(run, tries=2)
    with pytest.raises(RunDirLocked):
        check_unlocked(run)
    assert (run / LOCK_FILE).stat().st_mtime_ns == before  # refused attempts write nothing
    # the launcher's own worker (rank 0) recognises its launcher as the holder and does not wait on it
    delegated = RunLock.acquire(run, delegated_by=os.getpid(), tries=2)
    assert not delegated.held
    with pytest.raises(RunDirLocked):
        RunLock.acquire(run, delegated_by=os.getpid() + 1, tries=2)
    lock.release()
    check_unlocked(run)
    with RunLock.acquire(run) as again:
        assert again.held
    assert (run / LOCK_FILE).exists()  # the file stays (deleting lock files races); the lock does not


def test_a_refused_run_leaves_no_trace(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    RunLock.acquire(fresh).release(undo=True)
    assert not fresh.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "metrics.jsonl").write_text("")
    RunLock.acquire(existing).release(undo=True)
    assert sorted(p.name for p in existing.iterdir()) == ["metrics.jsonl"]


def _line(step: int, reward: float) -> str:
    return json.dumps({"step": step, "reward/mean": reward, "loss/policy": 0.5}) + "\n"


def test_resume_keeps_each_step_once_and_rebuilds_the_events(tmp_path: Path) -> None:
    """A killed run logged steps 1-5 (and, from an older polyrl, step 3 twice) and a half line; its last
    checkpoint is step 3. Opening for resume keeps exactly steps 1-3 (step 3's last line), replaces the
    file atomically, and TensorBoard shows steps 1-3 only; the next step is appended after them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    run.mkdir()
    metrics = run / "metrics.jsonl"
    metrics.write_text(_line(1, 0.1) + _line(2, 0.2) + _line(3, 0.0) + _line(3, 0.3) + _line(4, 0.4)
                       + _line(5, 0.5) + '{"step": 6, "rew')
    stale = RunDir(run).open("a: 1\n", resume_step=5)  # events for steps 1-5, as the killed run had them
    stale.close()
    inode = metrics.stat().st_ino
    rd = RunDir(run).open("a: 1\n", resume_step=3)
    try:
        assert metrics.stat().st_ino != inode  # a new file moved into place, not an in-place rewrite
        assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
        assert json.loads(metrics.read_text().splitlines()[2])["reward/mean"] == 0.3
        rd.log({"step": 4, "reward/mean": 0.44, "loss/policy": 0.5})
    finally:
        rd.close()
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]
    assert len(list((run / "events").iterdir())) == 1
    events = EventAccumulator(str(run / "events"))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("reward/mean")] == [
        (1, 0.1), (2, 0.2), (3, 0.3), (4, 0.44)]
    assert (run / "config.yaml").read_text() == "a: 1\n" and not (run / "config.yaml.tmp").exists()


def test_a_fresh_start_drops_a_killed_runs_history(tmp_path: Path) -> None:
    """Killed before its first checkpoint: the rerun starts over, so nothing of the old history stays."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(_line(1, 0.1) + _line(2, 0.2))
    RunDir(run).open("a: 1\n", resume_step=None).close()
    assert (run / "metrics.jsonl").read_text() == ""


def test_a_run_with_the_kl_loss_trains_and_reports_it(tmp_path: Path, run_cli, read_metrics) -> None:
    """``algorithm.use_kl_loss``: the KL term is aggregated as the policy loss is (it called ``aggregate`` with the
    policy loss's keyword ``agg`` and raised a TypeError at the first update)."""
    out = tmp_path / "run"
    rc, _, err = run_cli(["recipes/gpt_oss_dapo_tiny.yaml", "--output", str(out), "rollout.engine=hf",
                          "algorithm.use_kl_loss=true", "trainer.total_steps=2", "data.batch_size=4", "rollout.n=4",
                          "algorithm.mini_batch_size=8", "trainer.save_every=0"])
    assert rc == 0, err
    rows = read_metrics(out)
    assert len(rows) == 2 and all(math.isfinite(r["loss/kl"]) for r in rows)
