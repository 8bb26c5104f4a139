"""The hf engine's static decode (``rollout.decode: static``; ``graph`` is the same step captured by the backend's
device graph, here a stand-in that replays by running the step again):
the same tokens and log-probs as the dynamic decode within fp32 rounding, on both tiny model families, with
ragged prompts (left padding), a sliding window shorter than the sequences, stop tokens and repeated prompts; its
step reads no tensor value on the host (the property CUDA-graph capture needs); buffers are reused across calls
of one shape; the refusals."""

from __future__ import annotations

import pytest
import torch

from polyrl.core.models import build_model
from polyrl.core.rollout import SamplingParams, build_engine
from polyrl.core.rollout.static_decode import SLOT_ROUND, StaticDecoder, slots_for

PROMPTS = [[1, 5, 6, 7, 8, 9, 3, 4, 5], [1, 9, 8], [1, 4, 4, 4, 4], [1, 7], [1, 9, 8]]  # ragged, one repeated
MAX_TOKENS = 14  # with the window below, the last decode steps see only part of each row's slots


def _model(name: str):
    overrides = {"sliding_window": 4} if name == "gpt_oss_tiny" else None
    return build_model(name, vocab_size=17, seed=0, overrides=overrides).eval()


def _max_dlogp(a, b) -> float:
    """The largest log-prob difference between two rollouts of the same tokens."""
    return max(abs(p - q) for x, y in zip(a.logprobs, b.logprobs) for p, q in zip(x, y))


def _generate(model, decode: str, stop=(), seed: int = 0):
    engine = build_engine("hf", model, pad_token_id=0, decode=decode)
    params = SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS, stop_token_ids=list(stop))
    return engine, engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["gpt_oss_tiny", "deepseek_v3_tiny"])
@pytest.mark.parametrize("stop", [(), (3,)])
def test_static_decode_equals_dynamic(name: str, stop) -> None:
    model = _model(name)
    if name == "gpt_oss_tiny":
        assert model.config.sliding_window == 4 and "sliding_attention" in model.config.layer_types
    _, dyn = _generate(model, "dynamic", stop)
    engine, sta = _generate(model, "static", stop)
    assert sta.response_ids == dyn.response_ids
    assert sta.finish_reasons == dyn.finish_reasons
    if stop:
        assert "stop" in dyn.finish_reasons  # rows stopped early (and kept decoding padding)
    err = _max_dlogp(sta, dyn)
    assert err < 1e-5, err  # fp32: the decode attention sums over more (masked) slots, nothing else differs
    assert engine._static is not None and engine._static.slots == slots_for(9, MAX_TOKENS)


def test_the_window_mask_matters(monkeypatch) -> None:
    """Mutation check of the windowed masks: without them (every layer sees all its slots) the log-probs move."""
    from polyrl.core.attention.hf import StaticDecodeMasks

    model = _model("gpt_oss_tiny")
    _, dyn = _generate(model, "dynamic")
    original = StaticDecoder._step

    def no_window(self):
        self.masks.windowed.clear()  # mask_for(W) then derives it from the slot: still right
        original(self)
    with monkeypatch.context() as m:
        m.setattr(StaticDecoder, "_step", no_window)
        _, out = _generate(model, "static")
    err = _max_dlogp(out, dyn)
    assert err < 1e-5  # the on-the-fly window gives the same masks

    monkeypatch.setattr(StaticDecodeMasks, "mask_for", lambda self, window: self.full)  # the window dropped: wrong
    _, out = _generate(model, "static")
    err = _max_dlogp(out, dyn)
    assert err > 1e-3, err


def test_the_step_reads_no_tensor_on_the_host(monkeypatch) -> None:
    """What CUDA-graph capture needs: no .item() / bool() / int() / float() / .tolist() of a tensor inside the step."""
    model = _model("gpt_oss_tiny")
    engine = build_engine("hf", model, pad_token_id=0, decode="static")
    reads = []
    original = StaticDecoder._step

    def guarded(self):
        names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
        saved = {n: getattr(torch.Tensor, n) for n in names}

        def trap(name):
            def read(t, *a, **k):
                reads.append(name)
                return saved[name](t, *a, **k)
            return read
        for n in names:
            setattr(torch.Tensor, n, trap(n))
        try:
            original(self)
        finally:
            for n, f in saved.items():
                setattr(torch.Tensor, n, f)
    monkeypatch.setattr(StaticDecoder, "_step", guarded)
    engine.generate(PROMPTS, SamplingParams(temperature=0.9, max_tokens=6), generator=torch.Generator().manual_seed(0))
    assert reads == []
    # and the trap works: the dynamic decode's mask function does read the device
    from polyrl.core.attention import hf as H
    monkeypatch.setattr(H, "_STATIC_DECODE", None)
    seen = []
    saved_bool = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: seen.append(1) or saved_bool(t))
    build_engine("hf", model, pad_token_id=0).generate(PROMPTS, SamplingParams(max_tokens=3),
                                                       generator=torch.Generator().manual_seed(0))
    assert seen


def test_buffers_are_reused_for_one_shape_and_rebuilt_for_another() -> None:
    model = _model("deepseek_v3_tiny")
    engine, _ = _generate(model, "static")
    first = engine._static
    keys = first.cache.layers[0].keys
    engine.generate(PROMPTS[::-1], SamplingParams(max_tokens=MAX_TOKENS), generator=torch.Generator().manual_seed(1))
    assert engine._static is first and first.cache.layers[0].keys is keys  # same B, same slots: same buffers
    engine.generate([[1, 2] * 20], SamplingParams(max_tokens=3), generator=torch.Generator().manual_seed(1))
    assert engine._static is not first and engine._static.slots == slots_for(40, 3) == 48


def test_micro_batched_chunks_keep_their_own_decoders() -> None:
    """A rollout in chunks of 2 rows (5 prompts: 2, 2, 1) keeps one decoder per chunk shape, no rebuild per chunk."""
    model = _model("gpt_oss_tiny")
    _, dyn = _generate(model, "dynamic")
    engine = build_engine("hf", model, pad_token_id=0, decode="graph", backend=_GraphBackend())
    params = SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS, micro_batch_size=2)
    out = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(0))
    assert out.response_ids == dyn.response_ids  # rows sample from their own streams: chunking changes nothing
    assert sorted(d.batch for d in engine._statics) == [1, 2]
    before = [d.captures for d in engine._statics]
    engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(1))
    assert [d.captures for d in engine._statics] == before  # both shapes replayed, none captured again


def test_slots_round_up() -> None:
    assert slots_for(7, 6) == slots_for(11, 6) == SLOT_ROUND and slots_for(12, 6) == 2 * SLOT_ROUND
    assert slots_for(5, 1) == SLOT_ROUND  # one token: nothing fed back, still a slot for the step shape


class _ReplayingCapture:
    """A device graph's contract on the CPU: warm up once, call ``before_capture``, and "replay" by running the step
    again (so whatever the warm-up left behind that ``before_capture`` does not undo shows in the results)."""

    def __init__(self) -> None:
        self.captured = 0

    def __call__(self, step, before_capture=None):
        step()
        if before_capture is not None:
            before_capture()
        self.captured += 1
        return step


class _GraphBackend:
    name = "planted-graph"

    def __init__(self) -> None:
        self.capture = _ReplayingCapture()

    def device_graph(self):
        return self.capture


@pytest.mark.parametrize("name", ["gpt_oss_tiny", "deepseek_v3_tiny"])
def test_graph_mode_through_the_backends_capture(name: str) -> None:
    model = _model(name)
    _, dyn = _generate(model, "dynamic")
    backend = _GraphBackend()
    engine = build_engine("hf", model, pad_token_id=0, decode="graph", backend=backend)
    params = SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS)
    out = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(0))
    assert out.response_ids == dyn.response_ids  # the warm-up's cache writes and counters were undone
    assert _max_dlogp(out, dyn) < 1e-5
    assert backend.capture.captured == 1 and engine._static.captures == 1
    engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(3))
    assert backend.capture.captured == 1  # same shape, same weights: replayed
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head.data = head.data.clone()  # new storage (a LoRA merge swaps tensors): captured again
    engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(3))
    assert backend.capture.captured == 2


def test_without_the_restore_the_warm_up_shows() -> None:
    """Mutation check of the counter restore: a capture that skips ``before_capture`` leaves the cache one slot ahead."""
    model = _model("gpt_oss_tiny")
    _, dyn = _generate(model, "dynamic")
    backend = _GraphBackend()
    backend.capture = lambda step, before_capture=None: (step(), step)[1]
    engine = build_engine("hf", model, pad_token_id=0, decode="graph", backend=backend)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS),
                          generator=torch.Generator().manual_seed(0))
    err = _max_dlogp(out, dyn)
    assert out.response_ids != dyn.response_ids or err > 1e-3


def test_a_failed_capture_warns_once_and_decodes_without_a_graph() -> None:
    model = _model("gpt_oss_tiny")
    _, dyn = _generate(model, "dynamic")
    backend = _GraphBackend()
    calls = []

    def failing(step, before_capture=None):
        calls.append(1)
        step()
        before_capture()
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")
    backend.capture = failing
    engine = build_engine("hf", model, pad_token_id=0, decode="graph", backend=backend)
    with pytest.warns(RuntimeWarning, match=r"capturing the decode step failed \(RuntimeError: CUDA error: operation "
                                            r"not permitted when stream is capturing at rollout/test_static_decode.py:\d+ "
                                            r"\(failing\)\); this engine decodes without a graph"):
        out = engine.generate(PROMPTS, SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS),
                              generator=torch.Generator().manual_seed(0))
    assert out.response_ids == dyn.response_ids and len(calls) == 1
    assert engine._static.captures == 0 and engine._static.capture is None
    engine.generate([[1, 2] * 20], SamplingParams(max_tokens=3), generator=torch.Generator().manual_seed(1))
    assert len(calls) == 1 and engine.capture is None  # another shape: no second attempt, no second warning


def test_auto_falls_back_to_dynamic_after_a_failed_capture() -> None:
    """rollout.decode=auto's engine (graph, graph_fallback=dynamic): one warning naming the fallback, the call
    finishes on the static step with dynamic's tokens, later calls decode dynamically with no static buffers kept."""
    model = _model("gpt_oss_tiny")
    _, dyn = _generate(model, "dynamic")
    backend = _GraphBackend()

    def failing(step, before_capture=None):
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
    backend.capture = failing
    engine = build_engine("hf", model, pad_token_id=0, decode="graph", backend=backend, graph_fallback="dynamic")
    params = SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS)
    with pytest.warns(RuntimeWarning, match=r"decodes without a graph from now on \(as rollout.decode=dynamic\)"):
        out = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(0))
    assert out.response_ids == dyn.response_ids
    assert engine.decode == "dynamic" and engine._statics == [] and engine.capture is None
    again = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(0))
    assert again.response_ids == dyn.response_ids and again.logprobs == dyn.logprobs  # the dynamic decode itself
    assert engine._statics == []
    with pytest.raises(ValueError, match="graph_fallback='eager': expected static or dynamic"):
        build_engine("hf", model, pad_token_id=0, decode="graph", backend=_GraphBackend(), graph_fallback="eager")


def test_refusals() -> None:
    from polyrl.backends.cpu import CpuBackend

    model = _model("gpt_oss_tiny")
    with pytest.raises(ValueError, match="expected one of dynamic, static, graph"):
        build_engine("hf", model, pad_token_id=0, decode="cuda")
    with pytest.raises(ValueError, match="routing replay r3 needs decode='dynamic'"):
        build_engine("hf", model, pad_token_id=0, decode="static", return_routes=True)
    with pytest.raises(ValueError, match="backend 'cpu' does not"):
        build_engine("hf", model, pad_token_id=0, decode="graph", backend=CpuBackend())
    assert CpuBackend().device_graph() is None


@pytest.mark.parametrize("name", ["gpt_oss_tiny", "deepseek_v3_tiny"])
def test_fp32_experts_take_the_capturable_path_inside_a_captured_static_step(name: str, monkeypatch) -> None:
    """transformers' batched_mm experts (no host reads) inside the static step in float32 when the step is to be
    captured (graph), its grouped_mm path everywhere else (the prefill, the dynamic decode, an uncaptured static
    step, training); over the byte budget, grouped_mm again."""
    import transformers.integrations.moe as moe

    from polyrl.core.models import experts as E

    calls = {"batched": 0, "grouped": 0}
    real_b, real_g = moe.batched_mm_experts_forward, E.grouped_experts

    def batched(*a, **k):
        calls["batched"] += 1
        return real_b(*a, **k)

    def grouped(*a, **k):
        calls["grouped"] += 1
        return real_g(*a, **k)
    monkeypatch.setattr(moe, "batched_mm_experts_forward", batched)
    monkeypatch.setattr(E, "grouped_experts", grouped)
    model = _model(name)
    params = SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS)

    def graph_generate():
        engine = build_engine("hf", model, pad_token_id=0, decode="graph", backend=_GraphBackend())
        return engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(0))
    _, dyn = _generate(model, "dynamic")
    assert calls["batched"] == 0 and calls["grouped"] > 0
    for mode in ("static", "graph"):
        calls.update(batched=0, grouped=0)
        out = _generate(model, mode)[1] if mode == "static" else graph_generate()
        assert out.response_ids == dyn.response_ids and _max_dlogp(out, dyn) < 1e-5
        if mode == "static":
            assert calls["batched"] == 0 and calls["grouped"] > 0  # nothing captured: the cheaper path
        else:
            assert calls["batched"] > 0 and calls["grouped"] > 0  # decode steps batched, the prefill grouped
    monkeypatch.setattr(E, "STATIC_BATCHED_MAX_BYTES", 0)
    calls.update(batched=0, grouped=0)
    graph_generate()
    assert calls["batched"] == 0
