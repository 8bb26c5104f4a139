"""polyrl.core.attention.layouts: the layouts a model's layers call varlen attention with, read from its config."""

from __future__ import annotations

from types import SimpleNamespace

from polyrl.core.attention.layouts import AttentionLayout, attention_layouts
from polyrl.core.models.presets import model_config


def test_gpt_oss_has_a_sliding_and_a_full_layout_with_sinks():
    assert attention_layouts(model_config("gpt_oss_tiny")) == [
        AttentionLayout(4, 2, 32, 32, window=16, sinks=True), AttentionLayout(4, 2, 32, 32, window=None, sinks=True)]
    assert attention_layouts(model_config("gpt_oss_20b")) == [
        AttentionLayout(64, 8, 64, 64, window=128, sinks=True), AttentionLayout(64, 8, 64, 64, window=None, sinks=True)]
    # every layer full: one layout
    full = model_config("gpt_oss_tiny", layer_types=["full_attention", "full_attention"])
    assert attention_layouts(full) == [AttentionLayout(4, 2, 32, 32, window=None, sinks=True)]


def test_deepseek_mla_expands_to_one_key_head_per_query_head():
    assert attention_layouts(model_config("deepseek_v3_tiny")) == [AttentionLayout(4, 4, 48, 32)]
    assert attention_layouts(model_config("deepseek_v3")) == [AttentionLayout(128, 128, 192, 128)]


def test_other_decoders_read_heads_head_dim_and_window():
    from transformers import LlamaConfig, MistralConfig

    llama = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3)
    assert attention_layouts(llama) == [AttentionLayout(8, 2, 32, 32)]
    mistral = MistralConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, sliding_window=64)
    assert attention_layouts(mistral) == [AttentionLayout(8, 4, 32, 32, window=64)]
    off = SimpleNamespace(model_type="x", num_attention_heads=4, hidden_size=64, sliding_window=32,
                          use_sliding_window=False, num_hidden_layers=2)
    assert attention_layouts(off) == [AttentionLayout(4, 4, 16, 16)]
    assert attention_layouts(SimpleNamespace(model_type="vision")) == []
