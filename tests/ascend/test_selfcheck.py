"""The hardware self-check (polyrl.backends.ascend.selfcheck), run here on the emulator only: it passes where the
documented behaviour holds, says "not run" for a route the release cannot take, and FAILS when an assumption
breaks — here, a release whose softmax statistics are not in the documented per-sequence order."""

from __future__ import annotations

import torch

from polyrl.backends.ascend import selfcheck
from polyrl.emulation import npu as npu_emulator
from polyrl.emulation.npu import emulated_ascend_backend, install_emulator


def test_every_case_passes_on_the_documented_behaviour():
    with install_emulator():
        rows = selfcheck.run_self_check(emulated_ascend_backend())
    assert len(rows) == 12 and all(r.status == selfcheck.PASS for r in rows), [r.line() for r in rows]


def test_a_release_without_sink_reports_native_not_run_and_a_wrong_layout_fails(monkeypatch):
    def token_order(cum_q, n, n_kv, device):  # a release that kept the statistics in token order
        t = cum_q[-1]
        return torch.arange(t * n, device=device).view(t, n)

    with install_emulator("2.8.0", cann_version="8.3.RC1"):
        rows = selfcheck.run_self_check(emulated_ascend_backend())
        assert {r.status for r in rows if r.route == "native"} == {selfcheck.NOT_RUN}
        assert {r.status for r in rows if r.route == "lse"} == {selfcheck.PASS}
        monkeypatch.setattr(npu_emulator, "_stat_rows", token_order)
        rows = selfcheck.run_self_check(emulated_ascend_backend())
    assert any(r.status == selfcheck.FAIL for r in rows if r.route == "lse"), [r.line() for r in rows]
