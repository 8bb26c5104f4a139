"""The conformance kit passes the reference backend, fails a broken one, and never passes an unavailable one."""

from __future__ import annotations

from polyrl.backends.cpu import CpuBackend
from polyrl.core.backend import Availability
from polyrl.testing.conformance import FAIL, NOT_RUN, run_conformance


class SinkDroppingBackend(CpuBackend):
    """A classic bug: the kernel ignores the sinks (as plain FlashAttention-2 paths do)."""

    name = "sinkless"
    is_reference = False

    def varlen_attention(self, q, k, v, cu_seqlens, *, scale, window, sinks):
        return super().varlen_attention(q, k, v, cu_seqlens, scale=scale, window=window, sinks=None)


class OffByOneWindowBackend(CpuBackend):
    """FlashAttention's (W, 0) instead of (W - 1, 0): one key too many."""

    name = "window_plus_one"
    is_reference = False

    def varlen_attention(self, q, k, v, cu_seqlens, *, scale, window, sinks):
        return super().varlen_attention(q, k, v, cu_seqlens, scale=scale,
                                        window=None if window is None else window + 1, sinks=sinks)


class GradDoublingBackend(CpuBackend):
    """A backward bug that leaves the forward exact: dq (and everything) doubled through a custom hook."""

    name = "grad_doubling"
    is_reference = False

    def varlen_attention(self, q, k, v, cu_seqlens, *, scale, window, sinks):
        q2 = q * 1.0
        q2.register_hook(lambda g: 2 * g)
        return super().varlen_attention(q2, k, v, cu_seqlens, scale=scale, window=window, sinks=sinks)


class AbsentBackend(CpuBackend):
    name = "absent"
    is_reference = False

    def detect(self) -> Availability:
        return Availability(False, "no such device here")


def test_cpu_reference_conforms():
    report = run_conformance("cpu")
    assert report.ok, report.format()
    assert sum("varlen_attention" in c.name for c in report.checks) == 12


def test_sink_dropping_backend_fails_only_on_sink_cases():
    report = run_conformance(SinkDroppingBackend())
    failed = [c for c in report.checks if c.status == FAIL]
    assert not report.ok
    assert failed and all("sinks=True" in c.name for c in failed)


def test_window_off_by_one_fails():
    report = run_conformance(OffByOneWindowBackend())
    failed = [c for c in report.checks if c.status == FAIL]
    assert failed and all("window=None" not in c.name for c in failed)


def test_gradient_bug_with_exact_forward_fails():
    report = run_conformance(GradDoublingBackend())
    kernel_checks = [c for c in report.checks if "varlen_attention" in c.name]
    # Window 1 without sinks has dq == 0 exactly, so doubling it is invisible there; everywhere else it shows.
    visible = [c for c in kernel_checks if not ("window=1 " in c.name and "sinks=False" in c.name)]
    assert len(visible) == 10 and all(c.status == FAIL for c in visible)


def test_unavailable_backend_is_not_run_never_passed():
    report = run_conformance(AbsentBackend())
    assert any(c.status == NOT_RUN for c in report.checks)
    assert not report.ok
    assert run_conformance(AbsentBackend(), allow_unavailable=True).ok
