"""``polyrl export``: the exported HF directory loads with from_pretrained and gives the trainer's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, GptOssConfig, GptOssForCausalLM

from polyrl.cli import main as cli_main
from polyrl.core.run import checkpoint as C
from polyrl.core.run.export import save_model_metadata


def _tiny_gpt_oss() -> GptOssForCausalLM:
    cfg = GptOssConfig(
        vocab_size=24, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    return GptOssForCausalLM(cfg).eval()


def _tokenizer() -> Tokenizer:
    vocab = {str(i): i for i in range(10)} | {"<unk>": 10}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


@pytest.fixture
def trained_run(tmp_path: Path) -> tuple[Path, GptOssForCausalLM]:
    model = _tiny_gpt_oss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 24, (2, 9))
    model.train()
    for _ in range(2):  # the checkpoint must hold trained weights, not the init the export rebuilds
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    ckpt = tmp_path / "run" / "checkpoints"
    save_model_metadata(ckpt, model, _tokenizer())
    C.save_checkpoint(ckpt, 2, {"model": model, "optimizer": opt})
    return tmp_path / "run", model


def test_exported_model_logits_equal_the_trainers(trained_run: tuple[Path, GptOssForCausalLM], tmp_path: Path) -> None:
    run_dir, model = trained_run
    out = tmp_path / "hf"
    assert cli_main(["export", str(run_dir), str(out)]) == 0
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok("3 1 4 1 5 9 2 6")["input_ids"]])
    assert ids.tolist() == [[3, 1, 4, 1, 5, 9, 2, 6]]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_export_bad_input_exits_2(trained_run: tuple[Path, GptOssForCausalLM], tmp_path: Path, capsys) -> None:
    run_dir, _ = trained_run
    assert cli_main(["export", str(tmp_path / "nowhere"), str(tmp_path / "o1")]) == 2
    partial = run_dir / "checkpoints" / "step_00000009.tmp"
    partial.mkdir()
    assert cli_main(["export", str(partial), str(tmp_path / "o2")]) == 2
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert cli_main(["export", str(run_dir), str(busy)]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "incomplete" in err and "not empty" in err
