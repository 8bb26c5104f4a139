"""`polyrl run` of the tiny recipes on checkpoints in the published layouts (GPT-OSS MXFP4, DeepSeek-V3 block FP8):
a few steps train on the CPU, the dry run names the format, the run exports to a plain float model, and a
foreign quantization is refused in one line before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from published_checkpoints import write_tiny

from polyrl.cli import main as polyrl_main
from polyrl.core.plugins.selection import reset_active_backend

RECIPES = {"gpt_oss": "recipes/gpt_oss_dapo_tiny.yaml", "deepseek_v3": "recipes/deepseek_ppo_tiny.yaml"}
SMALL = {"gpt_oss": ["data.batch_size=8", "algorithm.mini_batch_size=64"],  # 8 prompts x 8 samples, one update
         "deepseek_v3": ["data.batch_size=16", "algorithm.mini_batch_size=16", "algorithm.ppo_epochs=1"]}
FORMAT = {"gpt_oss": "MXFP4 experts", "deepseek_v3": "block-FP8 linears"}


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> dict[str, Path]:
    return {arch: write_tiny(tmp_path_factory.mktemp(arch), arch)["published"] for arch in RECIPES}


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    reset_active_backend()
    rc = polyrl_main(args)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("arch", RECIPES)
def test_tiny_recipe_trains_from_the_published_layout_and_exports_float(arch, published, tmp_path, capsys) -> None:
    src = published[arch]
    rc, out, _ = _cli(["run", RECIPES[arch], f"model.name={src}", "--dry-run"], capsys)
    assert rc == 0
    assert f"note: architecture from checkpoint {src}: {FORMAT[arch]}" in out
    assert "dequantized to float32 at load" in out  # the tiny recipes train in fp32

    run = tmp_path / "run"
    rc, _, err = _cli(["run", RECIPES[arch], f"model.name={src}", "trainer.total_steps=2", "trainer.save_every=0", *SMALL[arch],
                       "--output", str(run), "--no-progress"], capsys)
    assert rc == 0, err
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(torch.isfinite(torch.tensor(m["loss/policy"])) for m in metrics)

    hf = tmp_path / "hf"
    rc, _, err = _cli(["export", str(run), str(hf)], capsys)
    assert rc == 0, err
    config = json.loads((hf / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"  # auto: the run's dtype
    from transformers import AutoModelForCausalLM

    from polyrl.core.models import build_model
    from polyrl.core.run.checkpoint import latest_checkpoint, load_model_weights

    exported = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager").eval()
    # the same weights reached through polyrl's own path: the published directory, then the step's DCP weights
    vocab = exported.get_input_embeddings().weight.shape[0]
    trained = build_model(src, vocab_size=vocab, attn_implementation="eager")
    initial = {n: t.clone() for n, t in trained.state_dict().items()}
    load_model_weights(latest_checkpoint(run / "checkpoints"), trained)
    trained.eval()
    assert any(not torch.equal(initial[n], t) for n, t in trained.state_dict().items())  # it did train
    ids = torch.tensor([[1, 4, 5, 6, 7, 8, 2, 4, 5]]) % vocab
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, trained(input_ids=ids).logits)


def test_a_foreign_quantization_is_refused_in_one_line(published, tmp_path, capsys) -> None:
    awq = tmp_path / "awq"
    shutil.copytree(published["gpt_oss"], awq)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (awq / "config.json").write_text(json.dumps(config))
    line = (f"polyrl run: error: model.name: checkpoint {str(awq)!r} is quantized with 'awq'; polyrl trains from "
            "float weights and dequantizes only mxfp4 and fp8 (block-scaled): convert it to bf16 first")
    # the dry run, a run, and the --nproc launcher before it starts any worker
    for extra in (["--dry-run"], ["--output", str(tmp_path / "run"), "--no-progress"],
                  ["--nproc", "2", "--output", str(tmp_path / "run"), "--no-progress"]):
        rc, out, err = _cli(["run", RECIPES["gpt_oss"], f"model.name={awq}", *extra], capsys)
        assert rc == 2 and out == ""
        assert err.strip().splitlines() == [line]
    assert not (tmp_path / "run").exists()
