"""The vllm rollout engine on the ascend backend, against stand-ins of vllm-ascend releases (tests/ascend/
vllm_ascend_standin.py: their allocator's assert, their worker's methods, their attention's window and sinks) —
on the CPU, never on an NPU.

Per release: 0.13 refuses GPT-OSS (its attention drops the sinks); every release syncs weights through the
model's ``load_weights`` followed by vLLM's post-load processing (the path vllm-ascend's own offline weight-load
example takes; its NPUWorker has no ``reload_weights`` before 0.24, and that one drops GPT-OSS's experts and sinks
as vLLM's does). Every release: no expandable segments with sleep mode, and the window told as W - 1 so that the
engine sees W keys, checked by the prefill probe and by the decode probe past the window.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import vllm_ascend_standin as standin
from tiny_models import adam_step, tiny_llama

from polyrl.backends import vllm_engine
from polyrl.backends.ascend import AscendBackend
from polyrl.backends.ascend import compat as ascend_compat
from polyrl.core.distributed.process_group import apply_env_defaults
from polyrl.core.errors import BadInputError
from polyrl.core.models import build_model
from polyrl.core.rollout import build_engine
from polyrl.core.tolerances import tolerance
from polyrl.core.trainer import sync

VOCAB = 64
BAR = tolerance("rollout.sync_probe", "bfloat16")  # the engine runs in bf16 (the fused attention's dtypes)
ALLOC = "PYTORCH_NPU_ALLOC_CONF"


@pytest.fixture
def ascend(monkeypatch):
    """The ascend backend (device mode: nothing here touches a device) seeing vllm-ascend installed; returns a
    function that selects the release (its version in the metadata, its stand-in as ``vllm``)."""
    monkeypatch.delenv("POLYRL_ASCEND_ON_CPU", raising=False)
    monkeypatch.delenv(ALLOC, raising=False)
    monkeypatch.setattr(vllm_engine, "vllm_problem", lambda *a, **k: "")  # vllm and vllm-ascend "installed"
    for key in ("VLLM_ASCEND_ENABLE_NZ", "VLLM_ENABLE_V1_MULTIPROCESSING"):  # what the engine sets, undone after
        monkeypatch.setenv(key, "0")

    def use(version: str, **changes) -> AscendBackend:
        release = dataclasses.replace(standin.RELEASES[version], **changes)
        monkeypatch.setattr(ascend_compat, "installed_vllm_ascend", lambda: version, raising=False)
        for name, mod in standin.modules(release).items():
            monkeypatch.setitem(sys.modules, name, mod)
        return AscendBackend()

    return use


def _llama():
    return tiny_llama(VOCAB)


def _gpt_oss():
    return build_model("gpt_oss_tiny", vocab_size=VOCAB, seed=0, backend="cpu")  # window 16, sinks, MoE


def _forward(packed: bool) -> dict:
    from polyrl.core.plugins import get_registry

    return dict(packed=packed, pad_id=0, chunk_size=1024, logprobs=get_registry().backends["cpu"].logprobs)


def _engine(model, backend):
    return build_engine("vllm", model, pad_token_id=0, backend=backend, max_model_len=64)


# --- sleep mode and the allocator ---------------------------------------------------------------------------
def test_the_backend_leaves_expandable_segments_off_where_vllm_ascend_sleeps(ascend, monkeypatch) -> None:
    backend = ascend("0.18.0")
    applied = apply_env_defaults(backend)  # what a run sets before the NPU runtime starts
    assert ALLOC not in applied and "HCCL_CONNECT_TIMEOUT" in applied
    engine = _engine(_llama(), backend)  # CaMemAllocator's assert passes
    assert engine._llm.kwargs["enable_sleep_mode"] and engine.settings.sleep_level == 1
    engine.close()
    # without vllm-ascend the allocator setting stays (no engine will sleep)
    monkeypatch.setattr(vllm_engine, "vllm_problem", lambda *a, **k: "vllm-ascend is not installed")
    assert AscendBackend().sharding_policy().env_defaults[ALLOC] == "expandable_segments:True"


def test_a_users_expandable_segments_are_refused_in_one_line(ascend, monkeypatch) -> None:
    backend = ascend("0.23.0")
    monkeypatch.setenv(ALLOC, "expandable_segments:True")
    with pytest.raises(BadInputError, match=r"PYTORCH_NPU_ALLOC_CONF=expandable_segments:True cannot be used .* "
                                            r"sleep mode") as info:
        _engine(_llama(), backend)
    assert "\n" not in str(info.value)


# --- weight sync per release -----------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.18.0", "0.23.0", "0.24.0rc1"])
def test_weights_sync_in_place_through_load_weights_then_post_processing(ascend, version) -> None:
    model = _llama()
    engine = _engine(model, ascend(version))
    assert engine._llm.kwargs["load_format"] == "dummy"  # built from the config alone, filled by the first sync
    seqs = sync.probe_sequences(model.config, VOCAB, max_len=40)
    assert sync.probe_diff(engine, model, seqs, **_forward(packed=False)) <= BAR
    for seed in (1, 2, 3):  # far enough for bf16's bar
        adam_step(model, seed, VOCAB)
    assert sync.probe_diff(engine, model, seqs, **_forward(packed=False)) > BAR  # the engine is behind
    engine.sleep()
    sync.wake_up(engine)
    engine._llm.calls.clear()
    engine.sync_weights(model)
    assert engine.weight_loader == "load_weights"
    assert sync.probe_diff(engine, model, seqs, **_forward(packed=False)) <= BAR
    assert engine._llm.calls[-3:] == ["load_weights", "process_weights_after_loading", "reset_prefix_cache"]
    assert "reload_weights" not in engine._llm.calls
    engine.close()


# --- GPT-OSS: sinks and the window -----------------------------------------------------------------------
def test_gpt_oss_is_refused_on_013_in_one_line_and_served_from_015(ascend) -> None:
    with pytest.raises(BadInputError, match=r"vllm-ascend 0.13.0 cannot roll out GPT-OSS: its attention drops the "
                                            r"sinks .* >= 0.15") as info:
        _engine(_gpt_oss(), ascend("0.13.0"))
    assert "\n" not in str(info.value)
    _engine(_llama(), ascend("0.13.0")).close()  # a model without sinks is served
    assert not ascend_compat.vllm_ascend_model_problem("0.15.0rc1", "gpt_oss")


@pytest.mark.parametrize("version", ["0.13.0", "0.14.0rc1"])
def test_auto_never_picks_an_engine_that_refuses_gpt_oss(ascend, version) -> None:
    """Before 0.15 the sinks are dropped: rollout.engine=auto resolves to hf and the run log says why; an explicit
    vllm is refused before the run starts, in one line (bad input: exit 2)."""
    from polyrl.core.rollout.engine import choose_engine

    backend = ascend(version)
    config = _gpt_oss().config
    name, why = choose_engine("auto", backend, config)
    assert name == "hf", why
    assert "\n" not in why and f"vllm: vllm-ascend {version} cannot roll out GPT-OSS" in why
    with pytest.raises(BadInputError, match=f"engine 'vllm' cannot run on backend 'ascend': vllm-ascend {version}") as info:
        choose_engine("vllm", backend, config)
    assert "\n" not in str(info.value)
    assert choose_engine("auto", ascend("0.15.0rc1"), config)[0] == "vllm"  # sinks from 0.15.0rc1


def test_without_the_refusal_013_would_roll_out_another_model(ascend) -> None:
    """What the refusal prevents: v0.13 drops the sinks, and its log-probs are not the trainer's."""
    backend = ascend("0.13.0")
    options = {**backend.rollout_engine_options("vllm"), "refused_models": {}}
    model = _gpt_oss()
    with torch.no_grad():  # sinks of a trained model's size (a random init's are small: bf16's bar would hide them)
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.fill_(2.0)
    engine = build_engine("vllm", model, pad_token_id=0, max_model_len=64,
                          settings=vllm_engine.VllmSettings.from_options(options))
    seqs = sync.probe_sequences(model.config, VOCAB, max_len=40)
    assert sync.probe_diff(engine, model, seqs, **_forward(packed=True)) > BAR
    engine.close()


@pytest.mark.parametrize("version", ["0.18.0", "0.24.0rc1"])
def test_the_window_is_told_as_w_minus_1_so_the_engine_sees_w_keys(ascend, version) -> None:
    backend = ascend(version)
    model = _gpt_oss()
    seqs = sync.probe_sequences(model.config, VOCAB, max_len=40)  # one sequence 24 tokens: past the window of 16
    engine = _engine(model, backend)
    assert engine._llm.kwargs["hf_overrides"] == {"sliding_window": 15}
    assert model.config.sliding_window == 16  # the trainer's model and the export keep W
    forward = _forward(packed=True)
    assert sync.probe_diff(engine, model, seqs, **forward) <= BAR
    assert engine.decode_probe_diff(lambda s: sync.trainer_logprobs(model, s, **forward)) <= BAR
    engine.close()
    # told W as vLLM means it, the release keeps W + 1 keys: the probe sees the difference
    options = {**backend.rollout_engine_options("vllm"), "sliding_window_offset": 0}
    plain = build_engine("vllm", model, pad_token_id=0, max_model_len=64,
                         settings=vllm_engine.VllmSettings.from_options(options))
    assert sync.probe_diff(plain, model, seqs, **forward) > BAR
    plain.close()


def test_the_decode_probe_catches_a_decode_kernel_that_drops_the_window(ascend) -> None:
    """A release whose decode attention ignores the band (all cached keys): its prefill log-probs are right, so
    the prefill probe passes; only tokens generated past the window show it."""
    model = _gpt_oss()
    engine = _engine(model, ascend("0.18.0", decode_window="ignored"))
    forward = _forward(packed=True)
    seqs = sync.probe_sequences(model.config, VOCAB, max_len=40)
    mine = sync.trainer_logprobs(model, seqs, **forward)
    assert max(abs(a - b) for m, t in zip(mine, engine.score(seqs)) for a, b in zip(m, t)) <= BAR  # prefill: right
    assert engine.decode_probe_diff(lambda s: sync.trainer_logprobs(model, s, **forward)) > BAR
    assert sync.probe_diff(engine, model, seqs, **forward) > BAR  # the sync's probe runs both
    engine.close()


def test_a_model_without_a_window_is_probed_in_decode_too(ascend) -> None:
    model = _llama()
    engine = _engine(model, ascend("0.23.0"))
    scored = []
    score = lambda s: scored.append(len(s[0])) or sync.trainer_logprobs(model, s, **_forward(packed=False))  # noqa: E731
    assert engine.decode_probe_diff(score) <= BAR
    assert scored and scored[0] > 4 + 1  # decoded past its 4-token prompt
    engine.close()


def test_decode_weights_the_post_processing_derives_are_probed_on_a_model_without_a_window(ascend, monkeypatch) -> None:
    """MLA decodes through matrices the post-load processing derives from the loaded weights (vllm-ascend's
    mla_v1): a sync that skips the processing — 0.2.0's engine on this path never ran it — leaves prefill right and
    decode on the old weights. The decode probe, which now runs for a model without a window, stops the run."""
    model = _llama()
    engine = _engine(model, ascend("0.23.0", decode_from_processed=True))
    seqs = sync.probe_sequences(model.config, VOCAB, max_len=40)
    forward = _forward(packed=False)
    adam_step(model, 7, VOCAB)
    sync.sync_and_verify(engine, model, seqs, engine.dtype, **forward)  # with the processing: both paths right
    for seed in (8, 9, 10):
        adam_step(model, seed, VOCAB)
    monkeypatch.setattr(vllm_engine.W, "post_process", lambda worker: None)  # the processing skipped
    with pytest.raises(sync.SyncFailed, match=r"in decode \(prefill [0-9.e-]+, decode"):
        sync.sync_and_verify(engine, model, seqs, engine.dtype, **forward)
    prefill, decode = sync.probe_diffs(engine, model, seqs, **forward)
    assert prefill <= BAR < decode, (prefill, decode)
    engine.close()


def test_compat_table_per_release() -> None:
    for version, release in standin.RELEASES.items():
        line, facts = ascend_compat.vllm_ascend_release(version)
        assert (facts.reload_weights, facts.gpt_oss_sinks) == (release.reload_weights, release.gpt_oss_sinks), line
        assert facts.pre_tokens_is_sliding_window
    assert ascend_compat.vllm_ascend_release("0.26.1")[0] == "0.24"  # a newer line: the newest facts, probed


# --- dtype ------------------------------------------------------------------------------------------------
def test_an_fp32_trainers_engine_runs_in_bf16_the_fused_attentions_dtype(ascend) -> None:
    """The fused attention ops of every tag take float16 / bfloat16 only: the engine of an fp32 trainer is built in
    bfloat16 and probed at that dtype's bar; built in the trainer's fp32 it would fail at its first forward."""
    model = _llama()
    backend = ascend("0.18.0")
    engine = _engine(model, backend)
    assert next(model.parameters()).dtype == torch.float32
    assert engine.dtype == "bfloat16" and engine._llm.kwargs["dtype"] == "bfloat16"
    seqs = sync.probe_sequences(model.config, VOCAB, max_len=40)
    measured = sync.probe_diff(engine, model, seqs, **_forward(packed=False))
    assert 0 < measured <= BAR  # bf16's rounding shows, within its bar
    engine.close()
    options = {**backend.rollout_engine_options("vllm"), "dtypes": ()}  # the engine left in the trainer's dtype
    fp32 = build_engine("vllm", model, pad_token_id=0, max_model_len=64,
                        settings=vllm_engine.VllmSettings.from_options(options))
    with pytest.raises(RuntimeError, match=r"query dtype torch\.float32 is not supported"):
        sync.probe_diff(fp32, model, seqs, **_forward(packed=False))
    fp32.close()
    assert vllm_engine.VllmSettings(dtypes=("bfloat16", "float16")).engine_dtype("llama", "float16") == "float16"
