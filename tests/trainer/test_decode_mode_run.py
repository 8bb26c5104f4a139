"""``rollout.decode`` through ``polyrl run``: a static-decode run of each tiny recipe gives the dynamic run's
rewards and response lengths, and losses within fp32 rounding; the modes that cannot run here are refused in one
line, exit 2, nothing written; ``auto`` (the default) resolves to graph only where a graph can run."""

from __future__ import annotations

from pathlib import Path

import pytest

SHORT = ["trainer.total_steps=3", "data.batch_size=8", "trainer.save_every=0"]


@pytest.mark.parametrize("recipe", ["gpt_oss_dapo_tiny", "deepseek_ppo_tiny"])
def test_static_decode_run_follows_the_dynamic_run(tmp_path: Path, run_cli, read_metrics, recipe: str) -> None:
    rows = {}
    for mode in ("dynamic", "static"):
        out = tmp_path / mode
        rc, _, err = run_cli([recipe, "--output", str(out), *SHORT, f"rollout.decode={mode}"])
        assert rc == 0, err
        engine_line = next(line for line in err.splitlines() if line.startswith("polyrl run: rollout engine hf"))
        assert engine_line.endswith("; decode static (rollout.decode=static)") == (mode == "static"), engine_line
        rows[mode] = read_metrics(out)
    assert len(rows["static"]) == len(rows["dynamic"]) == 3
    for s, d in zip(rows["static"], rows["dynamic"]):
        assert s["reward/mean"] == d["reward/mean"] and s["response/length_mean"] == d["response/length_mean"]
        assert abs(s["loss/total"] - d["loss/total"]) <= 1e-4 * max(1.0, abs(d["loss/total"])), (s, d)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.decode=graph"], "rollout.decode=graph: backend 'cpu' cannot capture device graphs"),
        (["rollout.decode=static", "rollout.routing_replay=r3"], "rollout.decode=static: routing replay r3"),
        (["rollout.decode=graphs"], "rollout.decode: expected one of 'auto', 'dynamic', 'static', 'graph'"),
    ],
)
def test_what_cannot_run_is_refused_in_one_line(tmp_path: Path, run_cli, overrides, message) -> None:
    out = tmp_path / "run"
    rc, _, err = run_cli(["gpt_oss_dapo_tiny", "--output", str(out), *SHORT, *overrides])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert message in err, err
    assert not out.exists()


class _Cfg:
    """The keys decode_option reads."""

    def __init__(self, decode: str, routing_replay: str = "off", lora: bool = False, merge: bool = True) -> None:
        from types import SimpleNamespace

        self.rollout = SimpleNamespace(decode=decode, routing_replay=routing_replay)
        self.model = SimpleNamespace(lora=SimpleNamespace(enabled=lora, merge_for_rollout=merge))


class _GraphCapable:
    name = "planted-graph"

    def device_graph(self):
        return lambda step, before_capture=None: step


def test_auto_takes_graph_only_where_it_can_run(monkeypatch) -> None:
    from polyrl.backends.cpu import CpuBackend
    from polyrl.core import distributed as D
    from polyrl.core.trainer.setup import decode_option

    graph = {"decode": "graph", "graph_fallback": "dynamic"}
    assert decode_option(_Cfg("auto"), "hf", _GraphCapable()) == graph
    assert decode_option(_Cfg("auto"), "hf", CpuBackend()) == {}  # no device graphs: the engine's dynamic decode
    assert decode_option(_Cfg("auto"), "vllm", _GraphCapable()) == {}  # another engine decodes its own way
    assert decode_option(_Cfg("auto", "r3"), "hf", _GraphCapable()) == {}  # r3 records routes every step
    assert decode_option(_Cfg("auto", "r2"), "hf", _GraphCapable()) == graph
    assert decode_option(_Cfg("auto", lora=True), "hf", _GraphCapable()) == {}  # merged: new weights every call
    assert decode_option(_Cfg("auto", lora=True, merge=False), "hf", _GraphCapable()) == graph
    assert decode_option(_Cfg("graph"), "hf", _GraphCapable()) == {"decode": "graph"}  # explicit: falls back to static
    monkeypatch.setattr(D, "get_world_size", lambda: 2)
    assert decode_option(_Cfg("auto"), "hf", _GraphCapable()) == {}  # FSDP2 gathers weights inside the forward


def test_the_default_on_cpu_is_the_dynamic_run(tmp_path: Path, run_cli, read_metrics) -> None:
    rows = {}
    for name, extra in (("default", []), ("dynamic", ["rollout.decode=dynamic"])):
        out = tmp_path / name
        rc, _, err = run_cli(["gpt_oss_dapo_tiny", "--output", str(out), *SHORT, *extra])
        assert rc == 0, err
        engine_line = next(line for line in err.splitlines() if line.startswith("polyrl run: rollout engine hf"))
        assert "; decode" not in engine_line, engine_line
        rows[name] = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(out)]
    assert rows["default"] == rows["dynamic"]
