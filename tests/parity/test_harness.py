"""`polyrl parity`: measured errors beside bars, in the backend's own dtype, on the conformance kit's cases;
an unavailable backend is `not run`, never passed."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

from planted_backends import WrongScaleBackend

from polyrl.backends.cpu import CpuBackend
from polyrl.core.plugins import ShardingPolicy
from polyrl.core.tolerances import tolerance
from polyrl.parity import FAIL, NOT_RUN, PASS, run_parity
from polyrl.testing.conformance import ATTENTION_CASES


class Bf16PolicyBackend(CpuBackend):
    """The reference kernel behind a backend that trains in bf16."""

    name = "bf16_policy"
    is_reference = False

    def sharding_policy(self) -> ShardingPolicy:
        return ShardingPolicy(param_dtype="bfloat16", reduce_dtype="float32")


def test_cpu_op_and_model_parity_pass_on_the_kits_cases_in_its_own_dtype():
    rows = run_parity(CpuBackend(), ("op", "model"))
    assert {r.level for r in rows} == {"op", "model"}
    assert all(r.status == PASS for r in rows), [r for r in rows if r.status != PASS]
    assert all(r.error is not None and r.bar is not None for r in rows)
    assert {r.dtype for r in rows} == {"float32"}  # the cpu backend's policy
    # The op level runs the conformance kit's case list: out, dq, dk, dv (, dsinks) of each case.
    op = [r for r in rows if r.level == "op"]
    assert {r.case.split(": ")[0].removeprefix("varlen_attention ") for r in op} == {c.name for c in ATTENTION_CASES}
    assert len(op) == sum(4 + (c.sinks is not None) for c in ATTENTION_CASES)


def test_op_level_uses_the_backends_dtype_policy_and_says_so():
    rows = run_parity(Bf16PolicyBackend(), ("op",))
    assert {r.dtype for r in rows} == {"bfloat16"}
    assert all(r.status == PASS for r in rows), [r for r in rows if r.status != PASS]
    assert {r.bar for r in rows if r.case.endswith(": out")} == {tolerance("attention.forward", "bfloat16")}
    # An explicit dtype overrides the policy.
    assert {r.dtype for r in run_parity(Bf16PolicyBackend(), ("model",), dtype="float16")} == {"float16"}


def test_a_buggy_backend_fails_op_parity_on_sink_cases_naming_the_symptom():
    rows = run_parity(WrongScaleBackend(), ("op",))
    failed = [r for r in rows if r.status == FAIL]
    sink_cases = {c.name for c in ATTENTION_CASES if c.sinks is not None}
    assert failed and {r.case.split(": ")[0].removeprefix("varlen_attention ") for r in failed} == sink_cases
    assert all(r.detail.startswith("output differs") for r in failed if r.case.endswith(": out"))


def test_model_level_runs_each_model_on_its_own_backend():
    """The cpu reference and the backend under test share weights in one process: each side must run its own
    attention, so the planted sink bug fails GPT-OSS (sinks) and leaves DeepSeek-V3 (none) passing."""
    rows = {r.case: r.status for r in run_parity(WrongScaleBackend(), ("model",))}
    assert rows == {"gpt_oss_tiny packed logprobs": FAIL, "deepseek_v3_tiny packed logprobs": PASS}


def test_cli_unavailable_backend_is_not_run_and_exits_1():
    proc = subprocess.run([sys.executable, "-m", "polyrl", "parity", "--backend", "cuda", "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    report = json.loads(proc.stdout)  # one object, a key per level
    for level in ("op", "model", "step", "recipe"):
        assert report[level]["status"] == NOT_RUN and report[level]["rows"]
        assert all(r["status"] == NOT_RUN and "not available" in r["detail"] for r in report[level]["rows"])


def test_cli_unknown_backend_exits_2():
    proc = subprocess.run([sys.executable, "-m", "polyrl", "parity", "--backend", "nope"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_rows_are_reported_as_they_complete():
    seen = []
    rows = run_parity(CpuBackend(), ("op", "model"), on_row=seen.append)
    assert seen == rows and rows[-1].level == "model"


def test_cli_states_the_dtype_and_references_and_prints_bars_to_two_digits(capsys):
    from polyrl.cli import main as polyrl_main

    rc = polyrl_main(["parity", "--backend", "cpu", "--level", "op", "--level", "model", "--dtype", "bfloat16"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert out[0] == f"parity of backend cpu (polyrl {metadata.version('polyrl')}) in bfloat16 (given by --dtype)"
    assert out[1].split()[:3] == ["op", "compared", "against"] and "rounded to bfloat16" in out[1]
    assert out[2].split()[:4] == ["model", "compared", "against", "the"] and "float32 model" in out[2]
    first = out[3]
    assert first.startswith("[   pass] op") and "bar 6.8e-03" in first
    assert any(line.startswith("[   pass] model") for line in out)
