"""Export a training checkpoint to a Hugging Face directory: safetensors weights, config, tokenizer.

The trainer calls ``save_model_metadata(ckpt_root, model, tokenizer)`` once per run: it writes the HF
config and the tokenizer files into ``<ckpt_root>/hf/`` (JSON and tokenizer files only, no weights).
``export_checkpoint`` rebuilds the model from that config with transformers (no network, no remote
code), loads the actor weights from the DCP checkpoint (any world size: DCP gathers the shards into the
full tensors), and writes ``save_pretrained`` output that ``AutoModelForCausalLM.from_pretrained``
loads. The checkpoint is verified first (sizes, checksums, structure, shapes against the config), exactly
as a resume verifies it. Nothing on the way unpickles: the config and tokenizer are JSON, the weights come through
polyrl.core.run.checkpoint's safe reader, and the output is safetensors.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyrl.core.dtypes import torch_dtype
from polyrl.core.errors import BadInputError
from polyrl.core.run.checkpoint import load_model_weights, refusal, resolve_checkpoint
from polyrl.core.run.faults import writing_whole
from polyrl.core.run.integrity import CheckpointRefused

if TYPE_CHECKING:
    from torch import nn

METADATA_DIR = "hf"


def save_model_metadata(ckpt_root: str | os.PathLike[str], model: nn.Module, tokenizer: Any | None) -> Path:
    """Write the HF config and tokenizer of ``model`` under ``<ckpt_root>/hf`` (rank 0 only, idempotent).

    ``model`` is the trainer's actor before sharding (a transformers PreTrainedModel: its
    ``config.save_pretrained`` is used). ``tokenizer`` may be a transformers tokenizer or a bare
    ``tokenizers.Tokenizer`` (wrapped into a fast tokenizer); None writes the config only.
    """
    from polyrl.core.distributed import get_rank

    out = Path(ckpt_root) / METADATA_DIR
    if get_rank() != 0:
        return out
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise TypeError(f"{type(model).__name__} has no Hugging Face config; cannot describe it for export")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    from polyrl.core.models.serving import serving_config

    serving_config(config).save_pretrained(tmp)  # with the fields inference engines' loaders need (vLLM)
    if tokenizer is not None:
        _as_hf_tokenizer(tokenizer).save_pretrained(tmp)
    from polyrl.core.models.lora import has_adapters

    if has_adapters(model):  # LoRA: peft's adapter_config.json, for the export to rebuild the adapters
        model.polyrl_lora.save_pretrained(tmp)
    (tmp / "polyrl_export.json").write_text(json.dumps({"model_class": type(model).__name__}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _as_hf_tokenizer(tokenizer: Any) -> Any:
    if hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    raise TypeError(f"cannot save a tokenizer of type {type(tokenizer).__name__}")


def find_metadata(step_dir: Path) -> Path:
    """``hf/`` next to the step directories, or in the run directory above them."""
    for base in (step_dir.parent, step_dir.parent.parent):
        candidate = base / METADATA_DIR
        if (candidate / "config.json").is_file():
            return candidate
    raise BadInputError(
        f"no model metadata ({METADATA_DIR}/config.json) next to checkpoint {str(step_dir)!r}; "
        "it is written by the trainer at the start of a run"
    )


def build_model_from_metadata(meta_dir: Path) -> nn.Module:
    """The HF model described by ``meta_dir/config.json``, on CPU, with freshly initialised weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(meta_dir, trust_remote_code=False)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        raise BadInputError(f"cannot read the model config in {str(meta_dir)!r}: {exc}") from exc
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
    return model.eval()


def export_checkpoint(
    checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, dtype: str = "auto"
) -> Path:
    """Write the actor of ``checkpoint`` (a step dir, a checkpoints dir or a run dir) to ``out_dir``; or, given a
    published checkpoint directory in MXFP4 or block FP8, that model dequantized (shard by shard).

    ``dtype``: "auto" is the dtype the run trained in (its config's ``dtype``), bfloat16 for a published
    directory; or float32 / bfloat16 / float16. Refuses a non-empty ``out_dir`` (BadInputError) rather than
    mixing two models' files, and a checkpoint that fails verification (``polyrl.core.run.integrity``), naming
    the file and the newest earlier checkpoint that verifies; it never exports that one in its place.
    """
    from polyrl.core.models.checkpoint_formats import dequantize_checkpoint, dequantized_bytes, read_format

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise BadInputError(f"output directory {str(out)!r} is not empty")
    if dtype != "auto":
        torch_dtype(dtype, what="export dtype")  # checked before anything is read or written
    source = Path(checkpoint)
    if source.is_dir() and read_format(source) is not None:
        float_dtype = torch_dtype("bfloat16" if dtype == "auto" else dtype)
        with writing_whole(out, dequantized_bytes(source, float_dtype), "the export"):
            return dequantize_checkpoint(source, out, float_dtype)
    step_dir = resolve_checkpoint(checkpoint)
    meta_dir = find_metadata(step_dir)
    model = build_model_from_metadata(meta_dir)  # parses config.json: a broken one is refused there
    lora = _adapters_of(meta_dir)
    if lora is not None:
        from peft import inject_adapter_in_model

        model = inject_adapter_in_model(lora, model)  # the checkpoint's names: base_layer / lora_A / lora_B
    trained = json.loads((meta_dir / "config.json").read_text()).get("dtype") or "float32"
    out_dtype = torch_dtype(trained if dtype == "auto" else dtype, what="export dtype")
    try:
        load_model_weights(step_dir, model)  # verified before a weight is touched
    except CheckpointRefused as exc:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        how = "export it with polyrl export {path} " + str(out)
        step = int(step_dir.name.split("_")[1])
        raise refusal(exc, step_dir.parent, step, how, {"model": get_model_state_dict(model)}) from None
    adapter = None
    if lora is not None:  # the merged model is the export; the adapter alone goes beside it in peft's format
        model, adapter = _merged_and_adapter(model, meta_dir)
    model = model.to(out_dtype)
    # all or nothing: refused before writing without the space, and a failed write (a full disk) leaves no
    # half-written model directory (one line, exit 1: polyrl.core.run.faults)
    with writing_whole(out, _export_bytes(model, meta_dir), "the export"):
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        for item in meta_dir.iterdir():  # tokenizer files (config.json came from save_pretrained just now)
            if item.is_file() and item.name not in ("config.json", "polyrl_export.json", ADAPTER_CONFIG):
                shutil.copy2(item, out / item.name)
        if adapter is not None:
            _save_adapter(adapter, meta_dir, out / ADAPTER_DIR)
    return out


ADAPTER_DIR = "adapter"  # LoRA: the adapter alone, in peft's format, under the export
ADAPTER_CONFIG = "adapter_config.json"


def _adapters_of(meta_dir: Path) -> Any:
    """peft's LoraConfig of a LoRA run (its ``adapter_config.json`` in the metadata), else None."""
    if not (meta_dir / ADAPTER_CONFIG).is_file():
        return None
    from peft import LoraConfig

    try:
        return LoraConfig.from_pretrained(str(meta_dir))
    except (ValueError, OSError, TypeError, json.JSONDecodeError) as exc:
        raise BadInputError(f"cannot read the LoRA config {str(meta_dir / ADAPTER_CONFIG)!r}: {exc}") from exc


def _merged_and_adapter(model: nn.Module, meta_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    """(the base architecture holding the merged weights, the adapters' tensors under peft's saved names)."""
    from polyrl.core.models.lora import adapter_state_dict, merged_tensors

    adapter = adapter_state_dict(model)
    merged = build_model_from_metadata(meta_dir)
    merged.load_state_dict(merged_tensors(model, model.state_dict()), strict=True)
    return merged, adapter


def _save_adapter(tensors: dict[str, Any], meta_dir: Path, out: Path) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors``: what ``PeftModel.save_pretrained`` writes, read by
    ``PeftModel.from_pretrained`` and by vLLM's LoRA loader."""
    from safetensors.torch import save_file

    out.mkdir()
    shutil.copy2(meta_dir / ADAPTER_CONFIG, out / ADAPTER_CONFIG)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def _export_bytes(model: nn.Module, meta_dir: Path) -> int:
    """What the export writes: each weight once (tied ones share storage) and the tokenizer files."""
    weights = {t.untyped_storage().data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    return sum(weights.values()) + sum(f.stat().st_size for f in meta_dir.iterdir() if f.is_file())
