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

    from polyrl.core.attention import varlen_attention
    from polyrl.core.tolerances import check_close

    dtype = getattr(torch, dtype_name)
    device = backend.device(0)
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
        results = {}
        for name, dev, dt in (("ref", torch.device("cpu"), torch.float32), ("dut", device, dtype)):
            # detach().clone(): .to() returns the same tensor when nothing changes, and the two runs must
            # not share leaves (they would then compare one .grad with itself).
            leaves = [x.detach().to(dev, dt).clone().requires_grad_() for x in (q, k, v)]
            s = sinks.detach().to(dev).clone().requires_grad_() if sinks is not None else None
            out = varlen_attention(*leaves, cu.to(dev), window=window, sinks=s,
                                   backend="cpu" if name == "ref" else backend)
            out.backward(dout.to(dev, dt))
            grads = [x.grad for x in leaves] + ([s.grad] if s is not None else [])
            results[name] = [out.float().cpu()] + [None if g is None else g.float().cpu() for g in grads]
        label = f"varlen_attention window={window} sinks={use_sinks} gqa={ratio} {dtype_name}"
        missing = [n for n, g in zip(("dq", "dk", "dv", "dsinks"), results["dut"][1:]) if g is None]
        if missing:
            checks.append(Check(label, FAIL, f"no gradient reached {', '.join(missing)}"))
            continue
        errs = []
        ok = True
        for i, (a, e) in enumerate(zip(results["dut"], results["ref"])):
            err, bar, passed = check_close("attention.forward" if i == 0 else "attention.grad", a, e, dtype)
            errs.append(f"{err:.1e}")
            ok = ok and passed
        checks.append(Check(label, PASS if ok else FAIL, f"rel err out/dq/dk/dv[/ds] = {'/'.join(errs)} (bar {bar:.0e})"))
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
