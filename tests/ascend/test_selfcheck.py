"""The hardware self-check (polyrl.backends.ascend.selfcheck), run here on the emulator only: it passes where the
documented behaviour holds, says "not run" for a route the release cannot take, and FAILS when an assumption
breaks — here, a release whose softmax statistics do not follow softmax_layout="TND", and a grouped matmul that
reads its groups from the other end."""

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


def test_the_all_to_all_check_sends_rows_and_an_empty_rank(monkeypatch):
    """On the emulated HCCL group: bf16 / fp32 / int64, five rows and none (the 0-row tensor an earlier byte route
    could not reshape); a release whose all-to-all lacks bf16 (2.8.0) goes through the byte route."""
    from polyrl.backends.ascend import ON_CPU_ENV
    from polyrl.emulation import hccl

    hccl.register()
    monkeypatch.setenv(ON_CPU_ENV, "1")
    for version in ("2.9.0", "2.8.0"):
        with install_emulator(version):
            rows = selfcheck.run_all_to_all_check(emulated_ascend_backend())
        assert len(rows) == 6 and all(r.status == selfcheck.PASS for r in rows), [r.line() for r in rows]
        assert any("empty rank" in r.line() and "bfloat16" in r.line() for r in rows)



def test_the_experts_check_fails_when_the_grouped_matmul_misbehaves(monkeypatch):
    """A release whose npu_grouped_matmul_add_ (the bf16 weight gradient) read the groups from the other end: the
    self-check names the bf16 experts rows (fp32's weight gradient takes no NPU op); the forward alone would not
    show it."""
    with install_emulator() as emu:
        real = emu.module.npu_grouped_matmul_add_

        def reversed_groups(y, x, weight, group_list, **kw):
            sizes = torch.diff(group_list, prepend=group_list.new_zeros(1)).flip(0)
            return real(y, x, weight, sizes.cumsum(0), **kw)

        monkeypatch.setattr(emu.module, "npu_grouped_matmul_add_", reversed_groups)
        rows = selfcheck.run_experts_check(emulated_ascend_backend())
    assert {r.status for r in rows if "bfloat16" in r.line()} == {selfcheck.FAIL}, [r.line() for r in rows]
    assert {r.status for r in rows if "float32" in r.line()} == {selfcheck.PASS}, [r.line() for r in rows]


def test_a_release_without_sink_reports_native_not_run_and_a_wrong_layout_fails(monkeypatch):
    real_out, real_in = npu_emulator._stats_out, npu_emulator._stats_in

    with install_emulator("2.8.0", cann_version="8.3.RC1"):  # TorchNPU 7.2.0: softmax_layout, no sink=
        rows = selfcheck.run_self_check(emulated_ascend_backend())
        assert {r.status for r in rows if r.route == "native"} == {selfcheck.NOT_RUN}
        assert {r.status for r in rows if r.route == "lse"} == {selfcheck.PASS}
        # a release that ignored softmax_layout="TND" (statistics in the default order)
        monkeypatch.setattr(npu_emulator, "_stats_out", lambda x, cum_q, layout, n_kv: real_out(x, cum_q, "", n_kv))
        monkeypatch.setattr(npu_emulator, "_stats_in", lambda x, cum_q, layout, n_kv: real_in(x, cum_q, "", n_kv))
        rows = selfcheck.run_self_check(emulated_ascend_backend())
    assert any(r.status == selfcheck.FAIL for r in rows if r.route == "lse"), [r.line() for r in rows]


def test_a_release_without_the_token_order_layout_reports_lse_not_run():
    with install_emulator("2.6.0", cann_version="8.2.RC1"):  # TorchNPU 7.1.0: neither sink= nor softmax_layout
        rows = selfcheck.run_self_check(emulated_ascend_backend())
    assert {r.status for r in rows} == {selfcheck.NOT_RUN}, [r.line() for r in rows]
    assert all('softmax_layout="TND"' in r.detail for r in rows if r.route == "lse")


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
    assert check["status"] == "pass" and check["returncode"] == 0, [ln for ln in check["output"] if "[   pass]" not in ln]
    # 12 attention cases, 4 experts cases, 6 all-to-all cases
    assert sum("[   pass]" in line for line in check["output"]) == 22
    assert rc == (0 if json.loads(out)["healthy"] else 1)


def test_doctor_self_check_is_not_run_without_the_backend_and_needs_a_backend(capsys):
    rc, out, _ = _doctor(capsys, "--backend", "ascend", "--selfcheck")
    assert rc == 1 and "self-check polyrl.backends.ascend.selfcheck: not run (backend ascend is not available" in out
    assert "pass" not in out.split("self-check")[-1].split("(")[0]
    rc, _, err = _doctor(capsys, "--selfcheck")
    assert rc == 2 and "--selfcheck needs --backend NAME" in err
    rc, _, err = _doctor(capsys, "--backend", "cpu", "--selfcheck")
    assert rc == 2 and "backend 'cpu' has no self-check" in err
