"""Write tiny checkpoints in the layouts the big models are published in, from a bf16 model (no hub).

GPT-OSS (``quant_method: mxfp4``): the MoE experts' ``gate_up_proj`` / ``down_proj`` are stored as
``<name>_blocks`` (uint8 [E, out, in/32, 16]: two e2m1 codes per byte, the even element in the low nibble) and
``<name>_scales`` (uint8 [E, out, in/32]: an e8m0 exponent, 2^(byte - 127), per 32 values along the input
dimension); the tensors are the transposes of transformers' parameters ([E, in, out]). Everything else stays
bf16 under its usual name, as in the published safetensors.

DeepSeek-V3 (``quant_method: fp8``, ``weight_block_size: [128, 128]``): every linear weight of attention, dense
MLP, routed and shared experts is float8_e4m3fn with a float32 ``<name>_scale_inv`` of
[ceil(out/128), ceil(in/128)] (the multiplier of its 128x128 block: w = fp8 x scale_inv); embeddings, LM head,
norms and the router stay bf16, the router's correction bias fp32.

The encoder is written from the format definitions, independently of polyrl's loader: each ``write_*`` returns
the values (fp32) a perfect dequantizer reproduces in its output dtype (under the names transformers' model uses), so a test can
compare a load with them exactly and with the original within the format's quantization error.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
GPT_OSS_MXFP4_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}
DEEPSEEK_FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [128, 128]}
_DEEPSEEK_FP8_WEIGHT = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.((experts\.\d+|shared_experts)\.)?(gate_proj|up_proj|down_proj))\.weight$")


def mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., K] (K a multiple of 32) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32], decoded fp32).

    The block's exponent is the smallest power of two that puts its largest magnitude within the e2m1 range
    (<= 6), so nothing clips; each value rounds to the nearest e2m1 value (ties to the even code)."""
    *lead, k = w.shape
    x = w.float().reshape(*lead, k // 32, 32)
    amax = x.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127.0)).clamp(-127, 127)
    y = x / torch.exp2(exp)
    grid = torch.tensor(E2M1_VALUES)
    dist = (y.abs().unsqueeze(-1) - grid).abs()
    # nearest grid point; on a tie the even code (the smaller index when it is even) as IEEE rounding does
    best = dist.argmin(-1)
    tie = torch.isclose(dist.gather(-1, best.unsqueeze(-1)).squeeze(-1),
                        dist.gather(-1, (best + 1).clamp(max=7).unsqueeze(-1)).squeeze(-1)) & (best < 7)
    best = torch.where(tie & (best % 2 == 1), best + 1, best)
    code = best | ((y < 0).to(torch.int64) << 3)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    decoded = (grid[best] * torch.where(y < 0, -1.0, 1.0) * torch.exp2(exp)).reshape(*lead, k)
    return packed, (exp + 127).squeeze(-1).to(torch.uint8), decoded


def fp8_block_encode(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> (float8_e4m3fn [out, in], scale_inv fp32 [ceil(out/b), ceil(in/b)], decoded fp32).

    Each block's scale maps its largest magnitude to 448 (e4m3's largest finite value); edge blocks are partial."""
    rows, cols = w.shape
    sr, sc = math.ceil(rows / block), math.ceil(cols / block)
    x = w.float()
    scale = torch.empty(sr, sc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    decoded = torch.empty(rows, cols)
    for i in range(sr):
        for j in range(sc):
            tile = x[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = tile.abs().amax().item() / 448.0 or 1.0
            scale[i, j] = s
            qt = (tile / s).to(torch.float8_e4m3fn)
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = qt
            decoded[i * block:(i + 1) * block, j * block:(j + 1) * block] = qt.float() * s
    return q, scale, decoded


def read_tensors(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``src``, by name."""
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return tensors


def _write_shards(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    """Split over ``shards`` files with a ``model.safetensors.index.json``, as the published repositories are."""
    names = sorted(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in names[i * per:(i + 1) * per]}
        save_file(part, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2))


def _copy_side_files(src: Path, out: Path, quantization_config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name != "config.json":
            shutil.copy2(item, out / item.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))


def write_gpt_oss_mxfp4(bf16_dir: str | Path, out: str | Path, shards: int = 3) -> dict[str, torch.Tensor]:
    """GPT-OSS ``bf16_dir`` (save_pretrained output) -> ``out`` in the published MXFP4 layout.
    Returns {transformers parameter name: the values (fp32) the MXFP4 encoding stands for} for the experts."""
    src, out = Path(bf16_dir), Path(out)
    _copy_side_files(src, out, GPT_OSS_MXFP4_CONFIG)
    tensors, expected = {}, {}
    for name, t in read_tensors(src).items():
        if re.fullmatch(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)", name):
            # [E, in, out] -> along `in` per row; one expert at a time bounds the encoder's temporaries
            parts = [mxfp4_encode(t[e].transpose(0, 1)) for e in range(t.shape[0])]
            blocks, scales, decoded = (torch.stack(x) for x in zip(*parts))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            expected[name] = decoded.transpose(1, 2).contiguous()
        else:
            tensors[name] = t.to(torch.bfloat16)
    _write_shards(tensors, out, shards)
    return expected


def write_deepseek_fp8(bf16_dir: str | Path, out: str | Path, shards: int = 3) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 ``bf16_dir`` (save_pretrained output: experts one by one, as published) -> ``out`` in the
    published block-FP8 layout. Returns {checkpoint name: the values (fp32) the FP8 encoding stands for}."""
    src, out = Path(bf16_dir), Path(out)
    _copy_side_files(src, out, DEEPSEEK_FP8_CONFIG)
    tensors, expected = {}, {}
    for name, t in read_tensors(src).items():
        if _DEEPSEEK_FP8_WEIGHT.fullmatch(name):
            q, scale, decoded = fp8_block_encode(t)
            tensors[name], tensors[f"{name}_scale_inv"] = q, scale
            expected[name] = decoded
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = t.float()
        else:
            tensors[name] = t.to(torch.bfloat16)
    _write_shards(tensors, out, shards)
    return expected


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
TINY = {"gpt_oss": ("gpt_oss_tiny", write_gpt_oss_mxfp4), "deepseek_v3": ("deepseek_v3_tiny", write_deepseek_fp8)}


def write_tiny(root: Path, arch: str) -> dict:
    """The tiny preset of ``arch`` ("gpt_oss" | "deepseek_v3") in bf16 with a tokenizer and a chat template
    (``original``), its published-layout encoding (``published``), and a float directory holding exactly the
    values the encoding stands for (fp32) under the original's names (``reference``); ``expected`` as returned
    by the writer."""
    from polyrl.core.models import build_model
    from polyrl.core.models.tokenizer import build_tiny_tokenizer

    preset, write = TINY[arch]
    original = root / "bf16"
    build_model(preset, dtype=torch.bfloat16, seed=0, attn_implementation="eager").save_pretrained(original)
    build_tiny_tokenizer().save_pretrained(original)
    (original / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    expected = write(original, root / "published")
    reference = root / "reference"
    reference.mkdir()
    save_file({**read_tensors(original), **expected}, reference / "model.safetensors", metadata={"format": "pt"})
    shutil.copy2(original / "config.json", reference / "config.json")
    return {"original": original, "published": root / "published", "reference": reference, "expected": expected}
