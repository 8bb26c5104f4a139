"""`polyrl parity`: measured errors beside bars; an unavailable backend is `not run`, never passed."""

from __future__ import annotations

import json
import subprocess
import sys

from polyrl.backends.cpu import CpuBackend
from polyrl.testing.parity import FAIL, NOT_RUN, PASS, run_parity


class WrongScaleBackend(CpuBackend):
    """Applies the softmax scale to the sinks too — a plausible kernel bug."""

    name = "wrong_scale"
    is_reference = False

    def varlen_attention(self, q, k, v, cu_seqlens, *, scale, window, sinks):
        return super().varlen_attention(q, k, v, cu_seqlens, scale=scale, window=window,
                                        sinks=None if sinks is None else sinks * scale)


def test_cpu_op_and_model_parity_pass_with_measured_errors():
    rows = run_parity(CpuBackend(), ("op", "model"))
    assert {r.level for r in rows} == {"op", "model"}
    assert all(r.status == PASS for r in rows), [r for r in rows if r.status != PASS]
    assert all(r.error is not None and r.bar is not None for r in rows)


def test_a_buggy_backend_fails_op_parity_on_sink_cases():
    import polyrl.core.plugins as plugins

    backend = WrongScaleBackend()
    rows = run_parity(backend, ("op",))
    failed = [r for r in rows if r.status == FAIL]
    assert failed and all("sinks=None" not in r.case for r in failed)
    plugins.reset_registry()


def test_unimplemented_levels_are_not_run():
    rows = run_parity(CpuBackend(), ("recipe",))
    assert [r.status for r in rows] == [NOT_RUN]


def test_cli_unavailable_backend_is_not_run_and_exits_1():
    proc = subprocess.run([sys.executable, "-m", "polyrl", "parity", "--backend", "cuda", "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    rows = json.loads(proc.stdout)["rows"]
    assert rows and all(r["status"] == NOT_RUN for r in rows)


def test_cli_unknown_backend_exits_2():
    proc = subprocess.run([sys.executable, "-m", "polyrl", "parity", "--backend", "nope"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
