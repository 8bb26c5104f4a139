"""The hf rollout engine: sampling log-probs equal the trainer's, stops, limits, top-p, determinism."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.models import build_model
from polyrl.core.rollout import SamplingParams, build_engine
from polyrl.core.rollout.hf import filter_logits
from polyrl.core.tolerances import relative_error, tolerance
from polyrl.core.trainer.batch import SequenceBatch, policy_forward

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 9, 8], [1, 4, 4, 4, 4], [1, 7]]  # ragged: left padding is exercised


@pytest.fixture(scope="module", params=["gpt_oss_tiny", "deepseek_v3_tiny"])
def model(request):
    return build_model(request.param, vocab_size=17, seed=0).eval()


def _full_logprobs(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_sampling_logprobs_match_a_full_forward(model) -> None:
    engine = build_engine("hf", model, pad_token_id=0)
    params = SamplingParams(temperature=0.7, max_tokens=5)
    out = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(0))
    for p, r, lp in zip(PROMPTS, out.response_ids, out.logprobs):
        assert len(r) == 5 and len(lp) == 5
        ref = _full_logprobs(model, p, r, 0.7)
        assert relative_error(torch.tensor(lp), ref) <= tolerance("rollout.logprobs", "float32")


def test_trainer_packed_forward_matches_engine_logprobs(model) -> None:
    engine = build_engine("hf", model, pad_token_id=0)
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=4), generator=torch.Generator().manual_seed(1))
    batch = SequenceBatch.from_rollout(PROMPTS, out.response_ids, out.logprobs, [0, 0, 1, 1])
    with torch.no_grad():
        packed, _ = policy_forward(model, batch, [0, 1, 2, 3], packed=True, pad_id=0, temperature=1.0,
                                   chunk_size=64, compute_entropy=False)
    err = relative_error(packed * batch.mask, batch.rollout_logp * batch.mask)
    assert err <= tolerance("rollout.logprobs", "float32")


def test_stop_tokens_and_length_limit(model) -> None:
    engine = build_engine("hf", model, pad_token_id=0)
    # every token but 0 is a stop token: each response is exactly one token, finished by "stop"
    params = SamplingParams(max_tokens=6, stop_token_ids=tuple(range(1, 17)))
    out = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(0))
    for r, reason in zip(out.response_ids, out.finish_reasons):
        # a response ends at its first stop token (any non-zero one); zeros before it are ordinary tokens
        first_stop = next((i for i, t in enumerate(r) if t != 0), None)
        if first_stop is None:
            assert (len(r), reason) == (6, "length")
        else:
            assert (len(r), reason) == (first_stop + 1, "stop")
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=3), generator=torch.Generator().manual_seed(0))
    assert all(len(r) == 3 for r in out.response_ids) and set(out.finish_reasons) == {"length"}


def test_same_generator_same_samples_and_micro_batching(model) -> None:
    engine = build_engine("hf", model, pad_token_id=0)
    a = engine.generate(PROMPTS, SamplingParams(max_tokens=4), generator=torch.Generator().manual_seed(5))
    b = engine.generate(PROMPTS, SamplingParams(max_tokens=4), generator=torch.Generator().manual_seed(5))
    assert a.response_ids == b.response_ids
    c = engine.generate(PROMPTS, SamplingParams(max_tokens=4), generator=torch.Generator().manual_seed(6))
    assert c.response_ids != a.response_ids


def test_tiny_top_p_is_greedy(model) -> None:
    engine = build_engine("hf", model, pad_token_id=0)
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=3, top_p=1e-6), generator=torch.Generator().manual_seed(0))
    for p, r in zip(PROMPTS, out.response_ids):
        ids = list(p)
        for tok in r:
            with torch.no_grad():
                assert tok == int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(tok)


def test_filter_logits_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 1.0, 2)).tolist() == [[False, False, True, True]]
    # mass before the 3rd token is 0.8 >= 0.8: it is dropped; the first two stay
    assert torch.isinf(filter_logits(logits, 0.8, -1)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, 0.81, -1)).tolist() == [[False, False, False, True]]


def test_repeated_prompts_are_prefilled_once_and_sample_as_alone(model) -> None:
    """The n samples of a prompt share its prefill (one row per distinct prompt), and each row samples what it
    samples alone with its seed: same tokens, same log-probs to the engine's tolerance."""
    prompts = [p for p in PROMPTS for _ in range(3)][::-1]  # 12 rows, 4 distinct prompts, not grouped in order
    seeds = list(range(100, 112))
    widths = []
    real = model.forward

    def spy(*args, **kwargs):
        widths.append(kwargs["input_ids"].shape)
        return real(*args, **kwargs)

    engine = build_engine("hf", model, pad_token_id=0)
    model.forward = spy
    try:
        out = engine.generate(prompts, SamplingParams(max_tokens=4), row_seeds=seeds)
    finally:
        del model.forward
    assert widths[0][0] == len(PROMPTS) and all(w[0] == len(prompts) for w in widths[1:]), widths
    for p, s, r, lp in zip(prompts, seeds, out.response_ids, out.logprobs):
        alone = engine.generate([p], SamplingParams(max_tokens=4), row_seeds=[s])
        assert alone.response_ids[0] == r
        assert relative_error(torch.tensor(lp), torch.tensor(alone.logprobs[0])) <= tolerance("rollout.logprobs",
                                                                                               "float32")


def test_row_uniforms_are_the_single_draws_in_blocks() -> None:
    from polyrl.core.rollout.sampling import RowUniforms, next_uniforms, row_generators

    seeds = [0, 7, 2**61 + 3]
    gens = row_generators(seeds)
    single = torch.stack([next_uniforms(gens, "cpu") for _ in range(11)], dim=1)  # [B, 11]
    for block in (1, 4, 64):
        rows = RowUniforms(seeds, "cpu", total=11, block=block)
        assert torch.equal(torch.stack([rows.at(t) for t in range(11)], dim=1), single), block
    with pytest.raises(ValueError, match="in order"):
        RowUniforms(seeds, "cpu", total=11).at(1)
