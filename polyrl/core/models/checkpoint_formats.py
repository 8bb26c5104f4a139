"""Checkpoints published with quantized weights, loaded for training in a float dtype (docs/recipes.md).

Two published layouts are read as they are downloaded and dequantized at load into the training dtype:

- ``quant_method: mxfp4`` (GPT-OSS): the MoE experts as ``*_blocks`` (two e2m1 values per byte) and
  ``*_scales`` (one e8m0 exponent per 32 values). transformers dequantizes these itself with
  ``Mxfp4Config(dequantize=True)`` on any host (no accelerate, triton or GPU needed), bit for bit, inside its
  ordinary loader (meta-device model, tensors read lazily from the mmap'd shards): polyrl uses that.
- ``quant_method: fp8`` with ``weight_block_size`` (DeepSeek-V3): linear weights in float8_e4m3fn, each
  [bm, bn] block scaled by the float32 ``<name>_scale_inv`` (w = fp8 x scale_inv). transformers' FP8 loader
  refuses to start without the accelerate package even when asked to dequantize, and derives the block size
  from the scale grid's shape (rows / scale rows), which is wrong for a partial edge block (DeepSeek-V3's
  ``kv_a_proj_with_mqa`` has 576 rows: 4.5 blocks of 128). polyrl dequantizes these itself with the block size
  from the config, as a lazy view of each shard that transformers' loader materialises one tensor at a time
  (its renames and expert merges still apply), so memory stays the model in the training dtype plus a few
  tensors in flight.

Any other ``quantization_config`` is refused (``BadInputError``) before anything is built, naming it.
``dequantize_checkpoint`` writes a published directory back out in a float dtype, shard by shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from polyrl.core.errors import BadInputError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SUPPORTED = ("mxfp4", "fp8")
_SCALE_SUFFIX = "_scale_inv"


@dataclasses.dataclass(frozen=True)
class QuantizedFormat:
    """A supported ``quantization_config`` of a checkpoint directory."""

    method: str  # "mxfp4" | "fp8"
    block: tuple[int, int] | None = None  # fp8: [rows, cols] of one scaled block

    def describe(self, dtype: str) -> str:
        """What a load does with it, for the dry-run plan."""
        if self.method == "mxfp4":
            return (f"MXFP4 experts (e2m1, an e8m0 scale per 32 values) dequantized to {dtype} at load by "
                    "transformers' loader")
        bm, bn = self.block or (0, 0)
        return f"block-FP8 linears (e4m3, a scale per {bm}x{bn} block) dequantized to {dtype} at load by polyrl"


def read_format(path: str | os.PathLike) -> QuantizedFormat | None:
    """The quantization of checkpoint directory ``path`` from its config.json: None for plain float weights, a
    ``QuantizedFormat`` polyrl dequantizes, or ``BadInputError`` (one line naming it) for any other."""
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        return None  # not a transformers checkpoint: the loader says what is missing
    except (OSError, ValueError) as exc:
        raise BadInputError(f"model.name: cannot read {str(file)!r} ({exc})") from None
    q = config.get("quantization_config") if isinstance(config, dict) else None
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    where = f"model.name: checkpoint {str(path)!r}"
    if method == "mxfp4":
        return QuantizedFormat("mxfp4")
    if method == "fp8":
        block = q.get("weight_block_size")
        fmt = q.get("fmt", "e4m3")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise BadInputError(f"{where} is FP8 without weight_block_size [rows, cols]; polyrl dequantizes "
                                "block-scaled FP8 only (quant_method fp8 with weight_block_size)")
        if fmt != "e4m3":
            raise BadInputError(f"{where} is FP8 in {fmt!r}; polyrl dequantizes e4m3 only")
        return QuantizedFormat("fp8", (block[0], block[1]))
    raise BadInputError(f"{where} is quantized with {method!r}; polyrl trains from float weights and dequantizes "
                        f"only {' and '.join(SUPPORTED)} (block-scaled): convert it to bf16 first")


def check_formats(*names: str | None) -> None:
    """``read_format`` of each name that is a checkpoint directory: a foreign quantization refused up front (the
    ``--nproc`` launcher, before any worker starts)."""
    for name in names:
        if name is not None and os.path.isdir(name):
            read_format(name)


def strip_quantization(config: Any) -> Any:
    """``config`` without its quantization block, so nothing downstream (export, the rollout engine's saved
    copy, a meta-device build) takes the float weights for quantized ones."""
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return config


# --- block FP8 --------------------------------------------------------------------------------------------------
# fp32 elements converted at a time: whole rows of blocks, ~64 MiB of temporaries (the largest DeepSeek-V3 weight,
# 18432 x 7168, is 8 steps)
CHUNK_ELEMENTS = 1 << 24


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype, *, name: str = "weight",
                          chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """float8 [rows, cols] x scale_inv [ceil(rows/bm), ceil(cols/bn)] -> ``dtype`` (fp32 products, rounded once),
    a few rows of blocks at a time. Edge blocks may be partial (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows)."""
    bm, bn = block
    if weight.dim() != 2:
        raise BadInputError(f"{name}: block-FP8 weight of shape {list(weight.shape)}; expected 2 dimensions")
    rows, cols = weight.shape
    expected = (math.ceil(rows / bm), math.ceil(cols / bn))
    if tuple(scale_inv.shape) != expected:
        raise BadInputError(f"{name}{_SCALE_SUFFIX}: shape {list(scale_inv.shape)} does not match weight "
                            f"{[rows, cols]} in {bm}x{bn} blocks (expected {list(expected)})")
    out = torch.empty(rows, cols, dtype=dtype)
    scale = scale_inv.float()
    step = bm * max(1, chunk_elements // (bm * cols))
    for r0 in range(0, rows, step):
        part = weight[r0:r0 + step].float()
        _scale_blocks_(part, scale[r0 // bm: r0 // bm + math.ceil(part.shape[0] / bm)], bm, bn)
        out[r0:r0 + step] = part
    return out


def _scale_blocks_(x: torch.Tensor, scale: torch.Tensor, bm: int, bn: int) -> None:
    """``x`` [n, c] *= ``scale`` [ceil(n/bm), ceil(c/bn)], each scale over its bm x bn block, in place: whole
    blocks as a broadcast over a blocked view (no expanded scale tensor), the partial last row / column apart."""
    n, c = x.shape
    fr, fc = n // bm * bm, c // bn * bn
    for r, sr, h in ((slice(0, fr), slice(0, fr // bm), bm), (slice(fr, n), slice(fr // bm, None), n - fr)):
        for col, sc, w in ((slice(0, fc), slice(0, fc // bn), bn), (slice(fc, c), slice(fc // bn, None), c - fc)):
            region = x[r, col]
            if region.numel():
                region.unflatten(0, (-1, h)).unflatten(2, (-1, w)).mul_(scale[sr, sc][:, None, :, None])


class _Fp8Tensor:
    """A block-FP8 weight as transformers' loader sees a checkpoint tensor: materialised by ``[...]``."""

    def __init__(self, weight: Any, scale: Any, block: tuple[int, int], dtype: torch.dtype, name: str):
        self.weight, self.scale, self.block, self.dtype, self.name = weight, scale, block, dtype, name

    def __getitem__(self, index: Any) -> torch.Tensor:
        full = dequantize_fp8_blocks(self.weight[...], self.scale[...], self.block, self.dtype, name=self.name)
        return full[index]

    def get_dtype(self) -> str:
        return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[self.dtype]

    def get_shape(self) -> list[int]:
        return list(self.weight.get_shape())


def shard_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory (those of its index when there is one)."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [root / f for f in sorted(set(weight_map.values()))]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise BadInputError(f"model.name: no safetensors weights in {str(root)!r}")
    return files


def _fp8_views(files: list[Path], block: tuple[int, int], dtype: torch.dtype,
               stack: contextlib.ExitStack) -> dict[str, Any]:
    """{checkpoint name: lazy tensor} over every shard: FP8 weights dequantize when read, the rest are the
    shards' own lazy slices. A weight and its scale may sit in different shards."""
    from safetensors import safe_open

    where: dict[str, Any] = {}
    for file in files:
        handle = stack.enter_context(safe_open(str(file), framework="pt"))
        where.update(dict.fromkeys(handle.keys(), handle))
    views: dict[str, Any] = {}
    for key, handle in where.items():
        if key.endswith(_SCALE_SUFFIX):
            if key[: -len(_SCALE_SUFFIX)] not in where:
                raise BadInputError(f"model.name: {key} has no weight {key[: -len(_SCALE_SUFFIX)]}")
            continue
        tensor = handle.get_slice(key)
        scale_key = key + _SCALE_SUFFIX
        if scale_key in where:
            views[key] = _Fp8Tensor(tensor, where[scale_key].get_slice(scale_key), block, dtype, key)
        elif tensor.get_dtype().startswith("F8"):
            raise BadInputError(f"model.name: FP8 weight {key} has no {scale_key}")
        else:
            views[key] = tensor
    return views


# --- loading ------------------------------------------------------------------------------------------------------
def load_dequantized(path: str, fmt: QuantizedFormat, config: Any, *, dtype: torch.dtype,
                     **kwargs: Any) -> PreTrainedModel:
    """The causal LM of checkpoint directory ``path`` in ``fmt``, dequantized to ``dtype`` at load.
    ``config``: its (possibly overridden) config; ``kwargs`` go to ``from_pretrained`` (attention, experts)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

    if fmt.method == "mxfp4":
        from transformers import Mxfp4Config

        with _quiet_mxfp4_serving_hint():
            model, info = AutoModelForCausalLM.from_pretrained(
                path, config=config, dtype=dtype, quantization_config=Mxfp4Config(dequantize=True),
                output_loading_info=True, **kwargs)
        _forget_mxfp4_conversions(model)
        if dtype != torch.bfloat16:
            # transformers' MXFP4 decoder returns bf16 whatever dtype was asked for, and the loader keeps it: the
            # experts would train in bf16 inside an fp32 model. A plain load never yields bf16 when asked for
            # another dtype (modules kept in fp32 stay fp32), so every bf16 tensor here is one of those.
            with torch.no_grad():
                for tensor in (*model.parameters(), *model.buffers()):
                    if tensor.dtype == torch.bfloat16:
                        tensor.data = tensor.data.to(dtype)
    else:
        assert fmt.block is not None
        config = strip_quantization(config)
        with contextlib.ExitStack() as stack:
            views = _fp8_views(shard_files(path), fmt.block, dtype, stack)
            # state_dict= makes transformers' loader read these views instead of the files: the same meta-device
            # build, renames (per-expert weights -> fused experts) and report of missing/unexpected keys.
            model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # the Auto class wants a path, not a dict
            model, info = model_class.from_pretrained(None, config=config, state_dict=views, dtype=dtype,
                                                      output_loading_info=True, **kwargs)
    # transformers only warns about these and initialises a missing weight at random: a name the dequantizer got
    # wrong would train from noise without a word
    bad = sorted(info.get("missing_keys", [])) + sorted(str(k[0]) for k in info.get("mismatched_keys", []))
    if bad:
        raise BadInputError(f"model.name: checkpoint {path!r} ({fmt.method}) lacks or mis-shapes {len(bad)} "
                            f"weight(s) of {type(model).__name__}: {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}")
    strip_quantization(model.config)
    if getattr(model, "hf_quantizer", None) is not None:  # a quantizer left attached would re-quantize on save
        model.hf_quantizer = None
    return model


def _forget_mxfp4_conversions(model: Any) -> None:
    """transformers records the conversions a load used on the model and reverses them in ``save_pretrained``;
    the reverse of its MXFP4 dequantization writes the experts under keys that exist nowhere (``down_proj$``), so
    the rollout engine's copy of the model (vLLM) and any save would not load. Dropped: the experts are plain
    float parameters now and save under their own names, as after a float load."""
    from transformers.integrations.mxfp4 import Mxfp4Dequantize

    used = getattr(model, "_weight_conversions", None) or []
    model._weight_conversions = [c for c in used if not any(
        isinstance(op, Mxfp4Dequantize) for op in getattr(c, "operations", []))]


@contextlib.contextmanager
def _quiet_mxfp4_serving_hint():
    """Drop transformers' hint that MXFP4 inference on CPU needs its kernels: polyrl asked for the dequantized
    model on purpose, and the hint would read as a problem in every CPU run's log. Other messages pass."""
    import logging

    hint = "MXFP4 inference on CPU requires use_kernels"
    logger = logging.getLogger("transformers.quantizers.quantizer_mxfp4")
    drop = logging.Filter()
    drop.filter = lambda record: hint not in record.getMessage()  # type: ignore[method-assign]
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


# --- export of a published directory ---------------------------------------------------------------------------
def dequantize_checkpoint(src: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype) -> Path:
    """Write published checkpoint ``src`` (MXFP4 or block FP8) to ``out`` in ``dtype``, shard by shard: one
    output shard per input shard, float weights under the names transformers and vLLM load for the float model
    (GPT-OSS experts ``gate_up_proj`` [E, H, 2I] / ``down_proj`` [E, I, H]; DeepSeek-V3 one weight per linear;
    tensors that were not quantized are written as stored),
    config.json without the quantization block, every other file (tokenizer, chat template) copied.
    Peak memory: one shard's tensors in ``dtype`` (plus its fp32 temporaries one row of blocks at a time)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    fmt = read_format(src)
    if fmt is None:
        raise BadInputError(f"{str(src)!r} has no quantization_config: its weights are already float")
    files = shard_files(src)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in files}
        where = {k: h for h in handles.values() for k in h.keys()}  # noqa: SIM118 (a safe_open handle is not iterable)
        for file, handle in handles.items():
            tensors = {}
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                for name, tensor in _dequantized(key, where, fmt, dtype):
                    tensors[name] = tensor.contiguous()
            save_file(tensors, out / file.name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file.name))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(item, out / item.name)
    return out


def dequantized_bytes(src: str | os.PathLike, dtype: torch.dtype) -> int:
    """What ``dequantize_checkpoint(src, ..., dtype)`` writes, from the shards' headers (nothing is read)."""
    from safetensors import safe_open

    fmt = read_format(src)
    item = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for file in shard_files(src):
        with safe_open(str(file), framework="pt") as handle:
            names = set(handle.keys())
            for key in names:
                view = handle.get_slice(key)
                numel = math.prod(view.get_shape())
                if key.endswith(("_scales", _SCALE_SUFFIX)):
                    continue
                if fmt is not None and fmt.method == "mxfp4" and key.endswith("_blocks"):
                    total += 2 * numel * item  # two e2m1 values per byte
                elif key + _SCALE_SUFFIX in names or view.get_dtype().startswith("F8"):
                    total += numel * item
                else:
                    total += numel * torch.empty(0, dtype=_SAFETENSORS_DTYPES.get(view.get_dtype(), torch.uint8)
                                                 ).element_size()
    return total + sum(f.stat().st_size for f in Path(src).iterdir() if f.is_file() and f.suffix != ".safetensors")


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "BOOL": torch.bool}


def _dequantized(key: str, where: dict[str, Any], fmt: QuantizedFormat, dtype: torch.dtype):
    """(name, tensor) pairs for checkpoint tensor ``key``: a quantized weight dequantized to ``dtype``, none for
    its scales (read with it), any other tensor as stored (the published float tensors are bf16 already, and the
    few kept in fp32, such as DeepSeek-V3's router correction bias, stay fp32 as in the published files)."""
    if fmt.method == "mxfp4":
        if key.endswith("_scales"):
            return []
        if key.endswith("_blocks"):
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors

            base = key[: -len("_blocks")]
            scales = where[base + "_scales"].get_tensor(base + "_scales")
            # transformers' own e2m1/e8m0 decoding, returning the [E, in, out] parameter layout
            return [(base, convert_moe_packed_tensors(where[key].get_tensor(key), scales, dtype=dtype))]
        return [(key, where[key].get_tensor(key))]
    if key.endswith(_SCALE_SUFFIX):
        return []
    tensor = where[key].get_tensor(key)
    scale_key = key + _SCALE_SUFFIX
    if scale_key in where:
        assert fmt.block is not None
        return [(key, dequantize_fp8_blocks(tensor, where[scale_key].get_tensor(scale_key), fmt.block, dtype,
                                            name=key))]
    return [(key, tensor)]
