"""algorithm.rollout_correction in `polyrl run`: what auto chooses on the hf engine (and says), the mismatch metrics of
every step, the masks in a real update, and a step whose every token is dropped (no optimizer step, nothing
non-finite)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from polyrl.core.algorithms import rollout_correction as RC

RC_KEY = "algorithm.rollout_correction"
RECOMPUTE = "algorithm.old_logprobs=recompute"
SHORT = ["trainer.total_steps=2", "data.batch_size=8", "trainer.save_every=0"]
MISMATCH = ["mismatch/applied", "mismatch/k1", "mismatch/k3", "mismatch/seq_k1", "mismatch/is_mean", "mismatch/is_max",
            "mismatch/is_clipped_frac", "mismatch/masked_frac", "mismatch/seq_is_mean", "mismatch/seq_is_max",
            "mismatch/seq_clipped_frac", "mismatch/seq_masked_frac"]


def _no_time(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def test_auto_is_off_on_the_hf_engine_and_equals_false(tmp_path: Path, run_cli, read_metrics) -> None:
    # π_old recomputed by the trainer (the hf engine's default takes the engine's log-probs, measured on the drift
    # check's steps only: tests/trainer/test_old_logprobs.py), so every step has the mismatch metrics
    rc, _, err = run_cli(["gpt_oss_dapo_tiny", "--output", str(tmp_path / "auto"), *SHORT, RECOMPUTE])
    assert rc == 0, err
    assert "rollout correction off (auto: engine hf shares the trainer weights); mismatch metrics only" in err
    auto = read_metrics(tmp_path / "auto")
    for r in auto:
        assert all(k in r and math.isfinite(r[k]) for k in MISMATCH), r
        assert r["mismatch/applied"] == 0
        # the hf engine's log-probs are the trainer's up to the KV cache's rounding
        assert abs(r["mismatch/k1"]) < 1e-6 and 0 <= r["mismatch/k3"] < 1e-9
        assert r["mismatch/is_clipped_frac"] == 0 and abs(r["mismatch/is_max"] - 1) < 1e-4
    rc, _, err = run_cli(["gpt_oss_dapo_tiny", "--output", str(tmp_path / "off"), *SHORT, RECOMPUTE,
                          f"{RC_KEY}.enable=false"])
    assert rc == 0, err
    assert "rollout correction off (algorithm.rollout_correction.enable=false)" in err
    assert _no_time(read_metrics(tmp_path / "off")) == _no_time(auto)


def test_every_correction_on_in_a_ppo_run(tmp_path: Path, run_cli, read_metrics) -> None:
    out = tmp_path / "run"
    rc, _, err = run_cli(["deepseek_ppo_tiny", "--output", str(out), *SHORT, f"{RC_KEY}.enable=true",
                          f"{RC_KEY}.is_level=geometric", f"{RC_KEY}.token_mask_band=[0.5, 5.0]",
                          f"{RC_KEY}.seq_reject=max_token", f"{RC_KEY}.seq_reject_band=[0.9, 1.1]"])
    assert rc == 0, err
    assert "rollout correction on (algorithm.rollout_correction.enable=true): geometric-level IS weights" in err
    for r in read_metrics(out):
        assert r["mismatch/applied"] == 1 and r["mismatch/masked_frac"] == 0  # hf: every ratio ~1 is inside
        assert r["actor/grad_norm"] > 0 and r["train/nonfinite_skipped"] == 0


def test_a_step_that_keeps_no_token_does_not_update(tmp_path: Path, run_cli, read_metrics, monkeypatch) -> None:
    monkeypatch.setattr(RC, "keep_mask", lambda delta, mask, **_: torch.zeros_like(delta))
    out = tmp_path / "run"
    rc, _, err = run_cli(["gpt_oss_dapo_tiny", "--output", str(out), *SHORT, f"{RC_KEY}.enable=true",
                          f"{RC_KEY}.token_mask_band=[0.5, 5.0]"])
    assert rc == 0, err
    for r in read_metrics(out):
        assert r["mismatch/masked_frac"] == 1.0 and r["mismatch/seq_masked_frac"] == 1.0
        assert r["actor/grad_norm"] == 0 and r["loss/policy"] == 0 and r["train/nonfinite_skipped"] == 0
