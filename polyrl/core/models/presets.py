"""The table of model presets, looked up by name, and ``model_config`` to build a config from one.

Full-size presets describe the public checkpoints (docs/background.md §3) so that recipes can name them; the
tiny presets keep the architecture (GPT-OSS: alternating sliding/full layers, sinks, MoE, YaRN rope;
DeepSeek-V3: MLA with Dv != D, MoE with shared experts and grouped routing, a first dense layer) at a
width an RL run trains on 2 CPU cores in about a minute. Tiny special tokens follow
:func:`polyrl.core.models.tokenizer.build_tiny_tokenizer`: <pad>=0, <bos>=1, <eos>=2.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# GPT-OSS: YaRN stretches a 4096-token rope by 32 to 131072 positions.
_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_GPT_OSS_FULL = {
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "sliding_window": 128,
    "num_experts_per_tok": 4,
    "max_position_embeddings": 131072,
    "rope_parameters": _GPT_OSS_ROPE,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "pad_token_id": 199999,
    "eos_token_id": 200002,
}
_DEEPSEEK_V3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
}

# name -> (model_type, config fields)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt_oss_20b": ("gpt_oss", {**_GPT_OSS_FULL, "num_hidden_layers": 24, "num_local_experts": 32}),
    "gpt_oss_120b": ("gpt_oss", {**_GPT_OSS_FULL, "num_hidden_layers": 36, "num_local_experts": 128}),
    "gpt_oss_tiny": (
        "gpt_oss",
        {
            "vocab_size": 64,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 2,  # layer 0 sliding, layer 1 full (layer_types derived from the count)
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,  # vLLM's CPU attention needs head_dim >= 32
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 16,  # small enough that RL-length sequences actually slide
            "max_position_embeddings": 131072,
            "rope_parameters": _GPT_OSS_ROPE,
            "attention_bias": True,
            "tie_word_embeddings": False,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    "deepseek_v3": (
        "deepseek_v3",
        {
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "n_shared_experts": 1,
            "n_routed_experts": 256,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 3,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "max_position_embeddings": 163840,
            "rope_parameters": _DEEPSEEK_V3_ROPE,
            "bos_token_id": 0,
            "eos_token_id": 1,
        },
    ),
    "deepseek_v3_tiny": (
        "deepseek_v3",
        {
            "vocab_size": 64,
            "hidden_size": 64,
            "intermediate_size": 128,  # the dense first layer
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_shared_experts": 1,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "kv_lora_rank": 32,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32,  # D = 48 for q and k ...
            "v_head_dim": 32,  # ... Dv = 32 for v
            "num_mtp_layers": 0,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def config_class(model_type: str) -> type:
    from transformers import AutoConfig

    return type(AutoConfig.for_model(model_type))


def known_fields(cls: type) -> set[str]:
    """Config fields an override may set: the dataclass fields plus the class's attribute aliases."""
    return {f.name for f in dataclasses.fields(cls)} | set(getattr(cls, "attribute_map", {}))


def check_overrides(cls: type, overrides: dict[str, Any], where: str) -> None:
    unknown = sorted(set(overrides) - known_fields(cls))
    if unknown:
        raise ValueError(f"unknown config field(s) for {where} ({cls.__name__}): {', '.join(unknown)}")


def model_config(name: str, **overrides: Any):
    """The transformers config of preset ``name`` with ``overrides`` (any config field) applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(preset_names())}")
    model_type, fields = PRESETS[name]
    cls = config_class(model_type)
    check_overrides(cls, overrides, f"preset {name!r}")
    return cls(**{**fields, **overrides})
