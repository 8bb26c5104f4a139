"""Ascend tests run on the CPU against polyrl.emulation.npu placed in sys.modules["torch_npu"]:
nothing here runs on an NPU, and no test leaves the emulator (or POLYRL_ASCEND_SINK) behind."""

from __future__ import annotations

import pytest

from polyrl.backends.ascend.attention import SINK_ENV
from polyrl.emulation.npu import install_emulator


@pytest.fixture
def npu(monkeypatch):
    """The default emulated release (torch_npu 2.9.0, CANN 8.5.0: native sinks available)."""
    monkeypatch.delenv(SINK_ENV, raising=False)
    with install_emulator() as emulator:
        yield emulator
