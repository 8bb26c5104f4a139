"""The main job on a real GPU, through the CLI: DAPO with dynamic sampling, PPO with critic and reference,
resume from a checkpoint, export — every device-placement path of the trainer on ``--backend cuda``.
Skipped cleanly without CUDA (these are part of ``bash bench/gpu_check.sh``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from polyrl.cli import main as polyrl_main
from polyrl.core.plugins.selection import reset_active_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHORT = ["trainer.total_steps=4", "trainer.save_every=2"]


def _run(args: list[str]) -> int:
    reset_active_backend()
    return polyrl_main(["run", *args, "--backend", "cuda", "--no-progress"])


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def test_the_engine_samples_the_same_tokens_on_the_gpu_and_the_cpu() -> None:
    """Uniforms come from per-row CPU generators: with fp32 weights the sampled tokens agree exactly
    (a differing token would need a probability within float rounding of a uniform)."""
    from polyrl.core.models import build_model
    from polyrl.core.plugins.selection import resolve_backend
    from polyrl.core.rollout import SamplingParams, build_engine

    prompts = [[1, 5, 6, 7], [1, 9], [1, 4, 4, 4, 4, 3], [1, 7]]
    outs = []
    for name in ("cpu", "cuda"):  # each model runs the backend it was built with (reference / Triton attention)
        backend = resolve_backend(name)
        model = build_model("gpt_oss_tiny", vocab_size=17, seed=0, backend=backend).to(backend.device()).eval()
        engine = build_engine("hf", model, pad_token_id=0)
        params = SamplingParams(max_tokens=6)
        outs.append(engine.generate(prompts, params, row_seeds=[11, 12, 13, 14]).response_ids)
    assert outs[0] == outs[1]


def test_dapo_with_dynamic_sampling_trains_on_the_gpu(tmp_path: Path) -> None:
    out = tmp_path / "dapo"
    rc = _run(["recipes/gpt_oss_dapo_tiny.yaml", "--output", str(out), *SHORT,
               "algorithm.dynamic_sampling.enable=true", "algorithm.dynamic_sampling.max_num_gen_batches=2",
               "algorithm.old_logprobs_check_every=1"])  # the trainer's forward every step: logprob_diff each row
    assert rc == 0
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["dapo/gen_batches"] >= 1 for r in rows)
    # the trainer's recomputed log-probs agree with the engine's sampling log-probs on the GPU too
    assert max(r["rollout/logprob_diff"] for r in rows) < 1e-3
    assert all(abs(r["actor/grad_norm"]) < float("inf") for r in rows if "actor/grad_norm" in r)


def test_ppo_with_critic_and_reference_trains_on_the_gpu(tmp_path: Path) -> None:
    out = tmp_path / "ppo"
    assert _run(["recipes/deepseek_ppo_tiny.yaml", "--output", str(out), *SHORT]) == 0
    rows = _metrics(out)
    assert len(rows) == 4
    assert all("loss/value" in r and "kl/actor_ref" in r for r in rows)


def test_resume_on_the_gpu_continues_exactly(tmp_path: Path) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert _run(["recipes/gpt_oss_dapo_tiny.yaml", "--output", str(whole), *SHORT]) == 0
    assert _run(["recipes/gpt_oss_dapo_tiny.yaml", "--output", str(split), "trainer.total_steps=2",
                 "trainer.save_every=2"]) == 0
    assert _run(["recipes/gpt_oss_dapo_tiny.yaml", "--output", str(split), *SHORT]) == 0
    a, b = _untimed(_metrics(whole)), _untimed(_metrics(split))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    # steps after the resume: same sampling seeds and shuffles (CPU generators restored), same weights
    for ra, rb in zip(a[2:], b[2:]):
        assert ra["reward/mean"] == rb["reward/mean"]
        assert abs(ra["loss/policy"] - rb["loss/policy"]) <= 1e-5 * max(1.0, abs(ra["loss/policy"]))


def test_export_of_a_gpu_run_loads_on_the_cpu(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    assert _run(["recipes/gpt_oss_dapo_tiny.yaml", "--output", str(out), "trainer.total_steps=2"]) == 0
    assert polyrl_main(["export", str(out), str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert next(model.parameters()).device.type == "cpu"
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()
