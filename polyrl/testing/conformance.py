"""Conformance kit for backend plugin authors.

A backend is conformant when it declares what DESIGN.md asks for and its kernels agree with the CPU
reference within the tolerance table. Use it from your plugin's test suite::

    from polyrl.testing.conformance import run_conformance
    def test_my_backend_conforms():
        report = run_conformance("mybackend")
        assert report.ok, report.format()

Checks that need the backend's hardware are reported as ``not run`` (never as passed) when
``detect()`` says the backend is not available; ``report.ok`` is then False unless
``allow_unavailable=True`` is passed, so a CI that lacks the device cannot mistake silence for success.
"""

from __future__ import annotations

import dataclasses
import itertools

from polyrl.core.backend import KERNELS, Availability, Backend, ShardingPolicy
from polyrl.core.plugins import list_backends

PASS, FAIL, NOT_RUN = "pass", "fail", "not run"

# Small op grid: enough to catch window/sink/GQA/ragged mistakes, cheap on any device.
ATTENTION_GRID = {
    "window": (None, 1, 3),
    "sinks": (False, True),
    "gqa": (1, 2),
}
DOC_LENS = (1, 5, 17)


@dataclasses.dataclass
class Check:
    name: str
    status: str
    detail: str = ""


@dataclasses.dataclass
class ConformanceReport:
    backend: str
    checks: list[Check]
    allow_unavailable: bool = False

    @property
    def ok(self) -> bool:
        bad = {FAIL} if self.allow_unavailable else {FAIL, NOT_RUN}
        return not any(c.status in bad for c in self.checks)

    def format(self) -> str:
        return "\n".join(f"[{c.status:>7}] {self.backend}: {c.name} {c.detail}" for c in self.checks)


def _declaration_checks(backend: Backend) -> list[Check]:
    checks = []
    for attr, kind in (("name", str), ("device_type", str), ("collective_backend", str)):
        value = getattr(backend, attr, None)
        ok = isinstance(value, kind) and bool(value)
        checks.append(Check(f"declares {attr}", PASS if ok else FAIL, repr(value)))
    unknown = set(backend.native_kernels) - set(KERNELS)
    checks.append(Check("native kernels are known kernel names", FAIL if unknown else PASS,
                        f"unknown: {sorted(unknown)}" if unknown else ""))
    avail = backend.detect()
    checks.append(Check("detect() returns Availability with a reason when unavailable",
                        PASS if isinstance(avail, Availability) and (avail.available or avail.reason) else FAIL,
                        repr(avail)))
    policy = backend.sharding_policy()
    ok = isinstance(policy, ShardingPolicy) and {policy.param_dtype, policy.reduce_dtype} <= {
        "float32", "bfloat16", "float16"}
    checks.append(Check("sharding policy uses known dtypes", PASS if ok else FAIL, repr(policy)))
    describe = backend.describe()
    checks.append(Check("describe() lists fallbacks", PASS if "kernels_fallback" in describe else FAIL))
    return checks


def _attention_checks(backend: Backend, dtype_name: str) -> list[Check]:
    import torch

    from polyrl.testing.parity import compare_attention_results, run_attention_case

    checks = []
    gen = torch.Generator().manual_seed(0)
    for window, use_sinks, ratio in itertools.product(*ATTENTION_GRID.values()):
        hkv, d = 2, 32
        hq = hkv * ratio
        t = sum(DOC_LENS)
        cu = torch.tensor([0, *itertools.accumulate(DOC_LENS)], dtype=torch.int32)
        q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hkv, hkv))
        sinks = torch.randn(hq, generator=gen) if use_sinks else None
        dout = torch.randn(t, hq, d, generator=gen)
        dut, ref = run_attention_case(backend, q, k, v, cu, sinks, dout, window, dtype_name)
        label = f"varlen_attention window={window} sinks={use_sinks} gqa={ratio} {dtype_name}"
        compared = compare_attention_results(dut, ref, dtype_name, window, use_sinks)
        missing = [what for what, err, _, _ in compared if err is None]
        if missing:
            checks.append(Check(label, FAIL, f"no gradient reached {', '.join(missing)}"))
            continue
        errs = "/".join(f"{err:.1e}" for _, err, _, _ in compared)
        ok = all(ok for *_, ok in compared)
        checks.append(Check(label, PASS if ok else FAIL,
                            f"rel err out/dq/dk/dv[/ds] = {errs} (bar {compared[-1][2]:.0e})"))
    return checks


def run_conformance(backend: str | Backend, *, dtype: str = "float32",
                    allow_unavailable: bool = False) -> ConformanceReport:
    """Run every check on ``backend`` (a registered name or an instance)."""
    if isinstance(backend, str):
        backends = list_backends()
        if backend not in backends:
            raise KeyError(f"backend {backend!r} is not registered; registered: {sorted(backends)}")
        backend = backends[backend]
    checks = _declaration_checks(backend)
    if backend.detect().available:
        checks += _attention_checks(backend, dtype)
    else:
        checks.append(Check("kernels vs reference", NOT_RUN, f"backend not available: {backend.detect().reason}"))
    return ConformanceReport(backend.name, checks, allow_unavailable)
