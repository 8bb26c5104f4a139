"""The attention layouts a model's layers will call the varlen attention op with, read from its config before the
model is built: what a backend whose kernels compile on first use (Triton's) needs to compile them ahead of the
first step (``Backend.precompile``).

A layout is what selects a compiled kernel: head counts, head dims, the window, whether there are sinks. The number
of tokens never does (the kernels take it as a runtime value). Hardware-free; imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

from polyrl.core.plugins.kernels import AttentionLayout

__all__ = ["AttentionLayout", "attention_layouts"]


def attention_layouts(config: Any) -> list[AttentionLayout]:
    """The distinct layouts of ``config``'s layers (a transformers config), in layer order.

    GPT-OSS: sinks on every layer, the sliding window on the layers ``layer_types`` names sliding. DeepSeek-V3
    (MLA, expanded by transformers to one key head per query head): head dim qk_nope + qk_rope, value head dim
    v_head_dim. Other decoders: ``head_dim`` (or hidden_size / heads), ``num_key_value_heads``, and the sliding
    window on the layers ``layer_types`` marks, or on every layer where the config has one and does not turn it off.
    A config without attention heads gives no layout (nothing to compile ahead; nothing is refused)."""
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        return []
    model_type = getattr(config, "model_type", "")
    if model_type in ("deepseek_v3", "deepseek_v2"):
        d = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        return [AttentionLayout(heads, heads, d, int(config.v_head_dim))]
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    sinks = model_type == "gpt_oss"
    window = getattr(config, "sliding_window", None) or None
    n_layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    types = getattr(config, "layer_types", None) or [
        "sliding_attention" if window and getattr(config, "use_sliding_window", True) else "full_attention"
    ] * n_layers
    layouts: list[AttentionLayout] = []
    for kind in types:
        layout = AttentionLayout(heads, int(kv), int(d), int(d), window if kind == "sliding_attention" else None,
                                 sinks)
        if layout not in layouts:
            layouts.append(layout)
    return layouts
