"""The hf engine's decode steps run the model's backend's decode slot (``Backend.decode_attention``), not the core
op directly: a planted backend whose slot is the core reference called through a counting function of its own
generates IDENTICAL tokens and log-probs to the cpu backend, and its slot sees every layer of every decode step; a
planted backend whose slot raises makes generation fail."""

from __future__ import annotations

import pytest
import torch
from planted_backends import DECODE_CALLS, CountingDecodeBackend, RefusingDecodeBackend

from polyrl.backends.cpu import CpuBackend
from polyrl.core.models import build_model
from polyrl.core.rollout import SamplingParams, build_engine

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 9, 8], [1, 4, 4, 4, 4], [1, 7]]  # ragged: left padding in the decode steps
MAX_TOKENS = 5


def _generate(backend):
    model = build_model("gpt_oss_tiny", vocab_size=17, seed=0, backend=backend).eval()
    engine = build_engine("hf", model, pad_token_id=0)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.7, max_tokens=MAX_TOKENS),
                          generator=torch.Generator().manual_seed(0))
    return model, out


def test_the_engine_routes_decode_through_the_backends_slot_with_identical_results():
    DECODE_CALLS.clear()
    _, reference = _generate(CpuBackend())
    assert DECODE_CALLS == []  # the cpu backend's slot is the reference itself
    model, planted = _generate(CountingDecodeBackend())
    assert planted.response_ids == reference.response_ids
    assert planted.logprobs == reference.logprobs  # bit for bit: the same reference, reached through the slot
    layers = model.config.num_hidden_layers
    # the prefill runs the packed path; each later forward (one per new token but the first) is a decode step
    assert len(DECODE_CALLS) == layers * (MAX_TOKENS - 1), DECODE_CALLS
    assert all(shape[:2] == (len(PROMPTS), 1) for shape in DECODE_CALLS)  # [B, Sq = 1, Hq, D]


def test_a_raising_decode_slot_fails_generation():
    with pytest.raises(RuntimeError, match="planted: the decode slot ran"):
        _generate(RefusingDecodeBackend())
