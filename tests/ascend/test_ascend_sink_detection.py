"""Which sink route the Ascend backend takes: the torch_npu / CANN table of docs/background.md §4, the
POLYRL_ASCEND_SINK override, and an old emulated release end to end (no sink= keyword at all)."""

from __future__ import annotations

import pytest
import torch

from polyrl.backends.ascend.attention import (
    SINK_ENV,
    cann_supports_sink,
    detect_sink_mode,
    sink_mode,
    torch_npu_supports_sink,
)
from polyrl.core.attention import varlen_attention
from polyrl.core.tolerances import check_close
from polyrl.emulation.npu import emulated_ascend_backend, install_emulator


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("2.5.1.post3", False), ("2.6.0", False), ("2.6.0.post4", False), ("2.6.0.post5", True),
        ("2.7.0", False), ("2.7.1", False), ("2.7.1.post1", False), ("2.7.1.post2", True),
        ("2.8.0", False), ("2.8.0.post1", False), ("2.8.0.post2", True), ("2.8.0.post3", True),
        ("2.9.0rc1", False), ("2.9.0", True), ("2.10.0.post4", True), ("3.0.0", True), ("", False), ("abc", False),
    ],
)
def test_torch_npu_release_table(version, supported):
    assert torch_npu_supports_sink(version) is supported


@pytest.mark.parametrize(
    ("cann", "supported"),
    [("8.5.0", True), ("8.5.1", True), ("9.1.0", True), ("8.3.RC1", False), ("8.5.RC1", False),
     ("8.5.0.alpha001", False), ("8.2.0", False), ("", False), (None, False)],
)
def test_cann_table(cann, supported):
    assert cann_supports_sink(cann) is supported


@pytest.mark.parametrize(
    ("version", "cann", "mode"),
    [("2.9.0", "8.5.0", "native"), ("2.8.0.post2", "8.5.1", "native"), ("2.9.0", "8.3.RC1", "lse"),
     ("2.8.0", "8.5.0", "lse"), ("2.7.1.post2", "", "lse")],
)
def test_detection_from_the_installed_release(monkeypatch, version, cann, mode):
    monkeypatch.delenv(SINK_ENV, raising=False)
    with install_emulator(version, cann_version=cann) as npu:
        got, reason = detect_sink_mode(npu.module)
        assert got == mode and reason
        assert sink_mode(npu.module) == mode


def test_environment_override(monkeypatch):
    with install_emulator("2.9.0") as npu:
        monkeypatch.setenv(SINK_ENV, "lse")
        assert sink_mode(npu.module) == "lse"
        monkeypatch.setenv(SINK_ENV, "Native")
        assert sink_mode(npu.module) == "native"
        monkeypatch.setenv(SINK_ENV, "eager")
        with pytest.raises(ValueError, match=SINK_ENV):
            sink_mode(npu.module)


def _attend(sinks, backend):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(12, h, 8, generator=gen).requires_grad_() for h in (4, 2, 2))
    s = sinks.clone().requires_grad_()
    out = varlen_attention(q, k, v, torch.tensor([0, 5, 12], dtype=torch.int32), window=3, sinks=s, backend=backend)
    out.square().sum().backward()
    return [out, q.grad, k.grad, v.grad, s.grad]


def test_old_release_takes_the_lse_route_and_forcing_native_fails_loudly(monkeypatch):
    monkeypatch.delenv(SINK_ENV, raising=False)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    expected = _attend(sinks, "cpu")
    with install_emulator("2.8.0", cann_version="8.3.RC1") as old:
        got = _attend(sinks, emulated_ascend_backend())
        assert not any(c["sink"] for c in old.calls)
        assert any(c["op"] == "npu_fusion_attention_grad" for c in old.calls)
        for i, (a, e) in enumerate(zip(got, expected)):
            assert check_close("attention.forward" if i == 0 else "attention.grad", a, e, torch.float32)[2]
        monkeypatch.setenv(SINK_ENV, "native")
        with pytest.raises(TypeError, match="sink"):
            _attend(sinks, emulated_ascend_backend())
