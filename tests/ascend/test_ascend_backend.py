"""The Ascend backend as a plugin: the conformance kit passes through the emulator in both sink routes,
nothing is claimed without it, and neither `import polyrl` nor `polyrl backends` imports torch_npu."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from polyrl.backends.ascend import AscendBackend
from polyrl.backends.ascend.attention import SINK_ENV
from polyrl.emulation.npu import emulated_ascend_backend, install_emulator
from polyrl.testing.conformance import ATTENTION_CASES, NOT_RUN, PASS, run_conformance


@pytest.mark.parametrize("mode", ["native", "lse"])
def test_conformance_kit_passes_on_the_emulator(monkeypatch, mode):
    monkeypatch.setenv(SINK_ENV, mode)
    with install_emulator():
        report = run_conformance(emulated_ascend_backend())
    assert report.ok, report.format()
    attention = [c for c in report.checks if "varlen_attention" in c.name]
    assert len(attention) == len(ATTENTION_CASES) and all(c.status == PASS for c in attention)


def test_without_the_emulator_nothing_is_claimed(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    report = run_conformance(emulated_ascend_backend())
    assert not report.ok and any(c.status == NOT_RUN for c in report.checks)


def test_ascend_declares_its_native_attention_and_experts():
    described = AscendBackend().describe()
    assert described["native_kernels"] == ["experts", "varlen_attention"]
    assert "varlen_attention" not in described["kernels_fallback"]


PROBE = r"""
import json, sys
import polyrl
import polyrl.backends.ascend
import polyrl.backends.ascend.attention
from polyrl.core.plugins import list_backends
ascend = list_backends()["ascend"].describe()
from polyrl.cli import main
assert main(["backends", "--json"]) == 0
print(json.dumps({"torch_npu": sorted(m for m in sys.modules if m.split(".")[0] == "torch_npu"),
                  "ascend_available": ascend["available"], "native": ascend["native_kernels"]}))
"""


def test_import_and_backends_command_do_not_import_torch_npu():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["torch_npu"] == []
    assert data["native"] == ["experts", "varlen_attention"]
    assert data["ascend_available"] is False  # no NPU here; the emulator is never installed by polyrl itself


def test_probe_sees_a_torch_npu_import():
    # The probe can fail: with the emulator imported first, torch_npu is in sys.modules.
    code = "from polyrl.emulation.npu import install_emulator; install_emulator()\n" + PROBE
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "torch_npu" in json.loads(proc.stdout.strip().splitlines()[-1])["torch_npu"]
