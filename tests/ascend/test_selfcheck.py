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
        experts = selfcheck.run_experts_check(emulated_ascend_backend())
    assert len(rows) == 12 and all(r.status == selfcheck.PASS for r in rows), [r.line() for r in rows]
    assert len(experts) == 4 and all(r.status == selfcheck.PASS for r in experts), [r.line() for r in experts]


def test_the_experts_check_fails_when_the_grouped_matmul_misbehaves(monkeypatch):
    """A release whose group_type=2 call (the weight gradient) read the groups from the other end: the self-check
    names the experts rows, the forward alone would not show it."""
    from polyrl.emulation import npu_moe

    real = npu_moe.npu_grouped_matmul

    def reversed_groups(x, weight, **kw):
        if kw.get("group_type") == 2:
            kw["group_list"] = kw["group_list"].flip(0)
        return real(x, weight, **kw)

    with install_emulator() as emu:
        monkeypatch.setattr(emu.module, "npu_grouped_matmul", reversed_groups)
        rows = selfcheck.run_experts_check(emulated_ascend_backend())
    assert all(r.status == selfcheck.FAIL for r in rows), [r.line() for r in rows]


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


# --- polyrl doctor --backend ascend --selfcheck ----------------------------------------------------------------
def _doctor(capsys, *args: str) -> tuple[int, str, str]:
    from polyrl.cli import main

    rc = main(["doctor", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_doctor_runs_the_self_check_where_the_backend_is_available(capsys, monkeypatch):
    """Here the child is the real self-check on the emulator (tests/ascend/emulated_selfcheck.py): the path doctor
    takes on an NPU machine, where the module is polyrl.backends.ascend.selfcheck itself."""
    import json
    import os
    from pathlib import Path

    from polyrl.backends.ascend import AscendBackend
    from polyrl.core.plugins.backend import Availability

    assert AscendBackend.selfcheck_module == "polyrl.backends.ascend.selfcheck"
    here = Path(__file__).parent
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(here), str(here.parents[1]), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(AscendBackend, "availability", lambda self: Availability(True, "an NPU (monkeypatched)"))
    monkeypatch.setattr(AscendBackend, "selfcheck_module", "emulated_selfcheck")
    rc, out, _ = _doctor(capsys, "--backend", "ascend", "--selfcheck", "--json")
    check = json.loads(out)["selfcheck"]
    assert check["status"] == "pass" and check["returncode"] == 0, check
    assert sum("[   pass]" in line for line in check["output"]) == 16  # 12 attention cases, 4 experts cases
    assert rc == (0 if json.loads(out)["healthy"] else 1)


def test_doctor_self_check_is_not_run_without_the_backend_and_needs_a_backend(capsys):
    rc, out, _ = _doctor(capsys, "--backend", "ascend", "--selfcheck")
    assert rc == 1 and "self-check polyrl.backends.ascend.selfcheck: not run (backend ascend is not available" in out
    assert "pass" not in out.split("self-check")[-1].split("(")[0]
    rc, _, err = _doctor(capsys, "--selfcheck")
    assert rc == 2 and "--selfcheck needs --backend NAME" in err
    rc, _, err = _doctor(capsys, "--backend", "cpu", "--selfcheck")
    assert rc == 2 and "backend 'cpu' has no self-check" in err
