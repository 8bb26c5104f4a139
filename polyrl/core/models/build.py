"""``build_model``: a causal LM from a local checkpoint directory or from a named preset (random init).

No network: a name is either an existing directory (``from_pretrained``; a published MXFP4 or block-FP8
checkpoint is dequantized to ``dtype`` at load, :mod:`polyrl.core.models.checkpoint_formats`) or a preset of
:mod:`polyrl.core.models.presets`; anything else is refused with the list of presets.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

import torch

from polyrl.core.models.checkpoint_formats import load_dequantized, read_format, strip_quantization
from polyrl.core.models.presets import PRESETS, check_overrides, model_config, preset_names

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from polyrl.core.plugins.backend import Backend


def model_config_for(name_or_path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> Any:
    """The transformers config ``build_model(name_or_path, overrides=overrides)`` builds from, without building:
    a checkpoint directory's (``AutoConfig``) or a preset's, with ``overrides``. Raises ValueError for a name that
    is neither (as ``build_model`` does)."""
    path = os.fspath(name_or_path)
    overrides = dict(overrides or {})
    if os.path.isdir(path):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path, **overrides)
    if path not in PRESETS:
        raise ValueError(
            f"{path!r} is neither a local checkpoint directory nor a model preset; presets: {', '.join(preset_names())}"
        )
    return model_config(path, **overrides)


def build_model(
    name_or_path: str | os.PathLike,
    *,
    vocab_size: int | None = None,
    attn_implementation: str = "polyrl",
    experts_implementation: str | None = None,
    dtype: torch.dtype = torch.float32,
    overrides: dict[str, Any] | None = None,
    seed: int | None = None,
    backend: Backend | str | None = None,
    meta: bool = False,
    device: torch.device | str | None = None,
) -> PreTrainedModel:
    """Build a causal LM.

    Args:
        name_or_path: a local checkpoint directory, or a preset name ("gpt_oss_tiny", "deepseek_v3_tiny",
            "gpt_oss_20b", "gpt_oss_120b", "deepseek_v3").
        vocab_size: embedding rows (presets: set in the config; checkpoints: embeddings resized if different).
        attn_implementation: "polyrl" (default), "eager", ...
        experts_implementation: transformers' MoE experts implementation (None: "polyrl", the experts kernel of
            the bound backend, polyrl.core.models.experts; "grouped_mm", "batched_mm", "eager": transformers' own).
        dtype: parameter dtype.
        overrides: config fields to change (any field of the model's config; unknown ones are refused).
        seed: seeds the random init of a preset without touching the global RNG state.
        backend: the backend whose kernels the model's ``"polyrl"`` attention runs, bound to the model for its
            life (a Backend, a backend name, or None: the process's active backend now). Rebind a built model
            with ``polyrl.core.attention.hf.bind_backend``.
        meta: the same architecture (parameters, buffers, dtypes) on the meta device, no weight read or drawn:
            what the ranks other than 0 of a sharded run build before rank 0's weights are loaded into their
            shards (:mod:`polyrl.core.distributed.loading`).
        device: where the weights are drawn or loaded (None: host memory). A preset drawn on an accelerator
            uses that device's generator (seeded by ``seed``, its state restored after): other values than on
            the host.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    import polyrl.core.attention.hf as hf_attention
    import polyrl.core.models.experts as hf_experts
    from polyrl.core.plugins.selection import backend_for

    hf_attention.register()  # idempotent: "polyrl" must be known before the model checks its implementation
    hf_experts.register()
    backend = backend_for(backend)
    overrides = dict(overrides or {})
    experts = {"experts_implementation": experts_implementation or hf_experts.NAME}
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        quantized = read_format(path)  # a foreign quantization is refused here, before anything is read
        config = AutoConfig.from_pretrained(path)
        check_overrides(type(config), overrides, f"checkpoint {path!r}")
        config = AutoConfig.from_pretrained(path, **overrides) if overrides else config
        if meta:
            # The dequantized load yields a float model: its architecture is the config without the quantization
            # block. The embeddings get the task's size directly (a resize would draw rows that the load overwrites).
            config = strip_quantization(config)
            if vocab_size is not None:
                config.vocab_size = vocab_size
            return _on_meta(config, dtype, attn_implementation, experts, backend)
        if quantized is not None:
            model = load_dequantized(path, quantized, config, dtype=dtype, attn_implementation=attn_implementation,
                                     **experts)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                path, config=config, attn_implementation=attn_implementation, dtype=dtype, **experts,
                **({"device_map": torch.device(device)} if device is not None else {}),
            )
        if vocab_size is not None and vocab_size != model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(vocab_size)
        hf_attention.bind_backend(model, backend)
        return model
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    config = model_config_for(path, overrides)
    if vocab_size is not None and getattr(config, "pad_token_id", None) is not None and config.pad_token_id >= vocab_size:
        config.pad_token_id = 0  # a preset's pad id beyond a task's small vocabulary (embedding row 0 is as good)
    if meta:
        return _on_meta(config, dtype, attn_implementation, experts, backend)
    where = torch.device(device) if device is not None else None
    # a device with a generator of its own (an accelerator's module has get_rng_state; torch.cpu has none): its
    # state is restored after the draws too
    own = where is not None and hasattr(torch.get_device_module(where), "get_rng_state")
    with torch.random.fork_rng(devices=[where] if own else [], device_type=where.type if own else "cuda"), \
            (where if where is not None else contextlib.nullcontext()):
        if seed is not None:
            torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype,
                                                 **experts)
    hf_attention.bind_backend(model, backend)
    return model




def _on_meta(config: Any, dtype: torch.dtype, attn_implementation: str, experts: dict, backend: Any) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    import polyrl.core.attention.hf as hf_attention

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype,
                                                 **experts)
    hf_attention.bind_backend(model, backend)
    return model
