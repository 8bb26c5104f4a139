"""Model presets, build_model, the tiny tokenizer, and the lazy transformers registration."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from polyrl.core.models import build_model, model_config, preset_names
from polyrl.core.models.tokenizer import build_tiny_tokenizer


def test_presets_listed():
    assert {"gpt_oss_tiny", "deepseek_v3_tiny", "gpt_oss_20b", "gpt_oss_120b", "deepseek_v3"} <= set(preset_names())


def test_gpt_oss_tiny_architecture():
    c = model_config("gpt_oss_tiny")
    assert c.model_type == "gpt_oss" and c.head_dim >= 32
    assert c.layer_types == ["sliding_attention", "full_attention"]
    assert c.rope_parameters["rope_type"] == "yarn" and "original_max_position_embeddings" in c.rope_parameters
    assert 1 < c.num_experts_per_tok < c.num_local_experts
    assert c.num_attention_heads % c.num_key_value_heads == 0 and c.num_attention_heads > c.num_key_value_heads
    # overriding the depth re-derives the alternating layer types
    assert model_config("gpt_oss_tiny", num_hidden_layers=4).layer_types[2:] == ["sliding_attention", "full_attention"]


def test_deepseek_v3_tiny_architecture():
    c = model_config("deepseek_v3_tiny")
    assert c.model_type == "deepseek_v3"
    assert c.qk_nope_head_dim + c.qk_rope_head_dim != c.v_head_dim  # Dv != D
    assert c.n_shared_experts >= 1 and c.first_k_dense_replace >= 1 and c.n_routed_experts > c.num_experts_per_tok


def test_full_size_presets_match_reference_facts():
    c = model_config("gpt_oss_20b")
    assert (c.num_hidden_layers, c.num_local_experts, c.hidden_size, c.vocab_size) == (24, 32, 2880, 201088)
    assert model_config("gpt_oss_120b").num_local_experts == 128
    d = model_config("deepseek_v3")
    assert (d.qk_nope_head_dim + d.qk_rope_head_dim, d.v_head_dim) == (192, 128)


def test_unknown_names_and_fields_are_refused():
    with pytest.raises(ValueError, match="hidden_sise"):
        model_config("gpt_oss_tiny", hidden_sise=8)
    with pytest.raises(ValueError, match="bogus, nope"):
        build_model("deepseek_v3_tiny", overrides={"nope": 1, "bogus": 2})
    with pytest.raises(ValueError, match="presets"):
        build_model("no_such_model")


def test_build_model_seed_overrides_and_checkpoint_round_trip(tmp_path):
    tok = build_tiny_tokenizer()
    state = torch.random.get_rng_state()
    a = build_model("gpt_oss_tiny", vocab_size=len(tok), seed=3, overrides={"hidden_size": 32})
    assert torch.equal(torch.random.get_rng_state(), state)  # the seed does not touch the global RNG
    b = build_model("gpt_oss_tiny", vocab_size=len(tok), seed=3, overrides={"hidden_size": 32})
    assert a.config.hidden_size == 32 and a.get_input_embeddings().weight.shape == (len(tok), 32)
    assert a.config._attn_implementation == "polyrl"
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    a.save_pretrained(tmp_path / "ckpt")
    c = build_model(tmp_path / "ckpt")
    assert c.config._attn_implementation == "polyrl"
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, c(ids).logits)
    bf = build_model("deepseek_v3_tiny", dtype=torch.bfloat16, seed=0)
    assert bf.get_input_embeddings().weight.dtype == torch.bfloat16


def test_tiny_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    tok = build_tiny_tokenizer()
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id] == [0, 1, 2]
    ids = tok("1 2 + 3 = 6").input_ids
    assert len(ids) == 6 and tok.unk_token_id not in ids
    assert tok.decode(ids) == "1 2 + 3 = 6"
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    assert back("1 2 + 3 = 6").input_ids == ids and len(back) == len(tok)
    custom = build_tiny_tokenizer(["a", "b"])
    assert len(custom) == 6 and custom("b a").input_ids == [5, 4]
    with pytest.raises(ValueError):
        build_tiny_tokenizer(["a", "a"])


PROBE = r"""
import json, sys
import polyrl
heavy = sorted(m for m in ("torch", "transformers", "triton", "vllm", "torch_npu") if m in sys.modules)
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="polyrl")
from transformers.masking_utils import AttentionMaskInterface
print(json.dumps({"heavy": heavy, "impl": model.config._attn_implementation,
                  "mask": "polyrl" in AttentionMaskInterface._global_mapping}))
"""


def test_import_polyrl_is_light_and_registers_lazily(tmp_path):
    build_model("gpt_oss_tiny", seed=0).save_pretrained(tmp_path)
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, check=True)
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data == {"heavy": [], "impl": "polyrl", "mask": True}


def test_a_preset_drawn_on_a_device_keeps_the_seed_and_the_callers_generators():
    """build_model(device=...): drawn there under the seed (on the host device the very draws of the default), the
    global generator untouched; a run's model.init_device=device builds the same model on the CPU backend."""
    import torch

    from polyrl.core.config import load_config
    from polyrl.core.models import build_model
    from polyrl.core.plugins import get_registry
    from polyrl.core.trainer.setup import build_models

    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    host = build_model("gpt_oss_tiny", vocab_size=16, seed=3)
    there = build_model("gpt_oss_tiny", vocab_size=16, seed=3, device="cpu")
    other = build_model("gpt_oss_tiny", vocab_size=16, seed=4, device="cpu")
    assert torch.equal(torch.random.get_rng_state(), before)
    a, b, c = host.state_dict(), there.state_dict(), other.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a) and all(v.device.type == "cpu" for v in b.values())
    assert not all(torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())  # the seed is used
    cfg = load_config("gpt_oss_dapo_tiny", ["model.init_device=device"])
    cpu = get_registry().backends["cpu"]
    built = build_models(cfg, 12, cpu, torch.device("cpu")).actor.state_dict()
    cfg.model.init_device = "host"
    default = build_models(cfg, 12, cpu, torch.device("cpu")).actor.state_dict()
    assert built.keys() == default.keys() and all(torch.equal(built[k], default[k]) for k in built)
