"""The conformance kit passes correct kernels (the cpu reference, the dummy plugin's chunked kernel) in fp32
and bf16, fails each planted bug naming its symptom first, and never passes an unavailable backend.

Planted bugs go into the dummy plugin's kernel (tests/plugins/polyrl_dummy_backend: pure torch, chunks of
32 queries), as a plugin author's mistakes would. They run in bf16, where the bars are widest.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from polyrl.backends.cpu import CpuBackend
from polyrl.core.plugins import Availability
from polyrl.core.tolerances import REFERENCE_ATTENTION_ERRORS
from polyrl.testing.conformance import (
    ATTENTION_CASES,
    FAIL,
    NOT_RUN,
    PASS,
    linear_logprobs_check,
    logprobs_check,
    run_conformance,
)

DUMMY_SRC = Path(__file__).parent.parent / "plugins" / "polyrl_dummy_backend"
BUGGY_DTYPE = "bfloat16"


@pytest.fixture
def dummy(monkeypatch):
    """The dummy plugin's backend class and its kernel module, imported from source, available."""
    monkeypatch.syspath_prepend(str(DUMMY_SRC))
    monkeypatch.setenv("POLYRL_DUMMY_AVAILABLE", "1")
    import polyrl_dummy_backend
    from polyrl_dummy_backend import attention

    return polyrl_dummy_backend.DummyBackend, attention


def kernel_checks(report):
    return {c.name: c for c in report.checks if c.name.startswith("varlen_attention")}


def case_of(check_name: str):
    return next(c for c in ATTENTION_CASES if check_name.startswith(f"varlen_attention {c.label()}"))


def failures(report) -> dict:
    """{case: detail} of the failing kernel checks, after checking the kit ran every case."""
    checks = kernel_checks(report)
    assert len(checks) == len(ATTENTION_CASES), report.format()
    return {case_of(name): c.detail for name, c in checks.items() if c.status == FAIL}


# --- correct kernels pass ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cpu_reference_conforms_and_the_bars_stay_derived_from_it(dtype):
    report = run_conformance("cpu", dtype=dtype)
    assert report.ok, report.format()
    # The rule of polyrl/core/tolerances.py: bars = margin x the reference's recorded worst error. The record
    # must still describe the reference: not understated (the bars would lose their margin), not stale.
    # float32's errors are accumulation order, which moves with the CPU's kernels (6.55e-7 dsinks on a 2-core AMD VM
    # of 2026-12-06 against the 6.4e-7 recorded): up to 1.5x the record passes there (its bars keep a margin of
    # 32 / 1.5 > 20); the half types' errors are the final rounding, the same on every machine.
    above = 1.5 if dtype == "float32" else 1.1
    measured, recorded = report.worst_errors(), REFERENCE_ATTENTION_ERRORS[dtype]
    assert set(measured) == set(recorded)
    drift = {k: f"measured {measured[k]:.2e}, recorded {recorded[k]:.1e}" for k in recorded
             if not recorded[k] / 2 <= measured[k] <= recorded[k] * above}
    assert not drift, f"update REFERENCE_ATTENTION_ERRORS[{dtype!r}] in polyrl/core/tolerances.py: {drift}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dummy_plugin_kernel_conforms(dummy, dtype):
    backend_cls, _ = dummy
    report = run_conformance(backend_cls(), dtype=dtype)
    assert report.ok, report.format()
    assert all(c.status == PASS for c in report.checks)


# --- planted bugs fail, each named by its symptom ------------------------------------------------------


def _buggy(backend_cls, name: str, kernel):
    """A subclass of the dummy backend whose varlen_attention is ``kernel(super_call, q, k, v, cu, **kw)``."""

    def varlen_attention(self, q, k, v, cu_seqlens, *, scale, window, sinks):
        return kernel(super(cls, self).varlen_attention, q, k, v, cu_seqlens, scale=scale, window=window,
                      sinks=sinks)

    cls = type(f"Buggy_{name}", (backend_cls,), {"name": name, "varlen_attention": varlen_attention})
    return cls()


def _window_plus_one(call, q, k, v, cu, *, scale, window, sinks):
    return call(q, k, v, cu, scale=scale, window=None if window is None else window + 1, sinks=sinks)


def _window_minus_one(call, q, k, v, cu, *, scale, window, sinks):  # FlashAttention's (W, 0) read as W keys
    return call(q, k, v, cu, scale=scale, window=None if window is None else window - 1, sinks=sinks)


def _sinks_ignored(call, q, k, v, cu, *, scale, window, sinks):  # plain FlashAttention-2 paths
    return call(q, k, v, cu, scale=scale, window=window, sinks=None)


def _sinks_scaled(call, q, k, v, cu, *, scale, window, sinks):  # the sink treated as a logit to scale
    return call(q, k, v, cu, scale=scale, window=window, sinks=None if sinks is None else sinks * scale)


def _scale_ignored(call, q, k, v, cu, *, scale, window, sinks):  # DeepSeek-V3's YaRN mscale lost
    return call(q, k, v, cu, scale=q.shape[-1] ** -0.5, window=window, sinks=sinks)


def _scale_from_dv(call, q, k, v, cu, *, scale, window, sinks):  # head dim of V taken for the scale
    return call(q, k, v, cu, scale=v.shape[-1] ** -0.5, window=window, sinks=sinks)


def _gqa_modulo(call, q, k, v, cu, *, scale, window, sinks):
    """Query head h reads key/value head h % Hkv instead of h // G (repeat instead of repeat_interleave)."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    h = torch.arange(hq)
    perm = (h % hkv) * g + h // hkv  # query head h is computed as the head that reads kv head h % Hkv
    out = call(q[:, perm], k, v, cu, scale=scale, window=window, sinks=None if sinks is None else sinks[perm])
    return out[:, torch.argsort(perm)]


def _fp32_output(call, q, k, v, cu, *, scale, window, sinks):
    return call(q, k, v, cu, scale=scale, window=window, sinks=sinks).float()


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def _dk_scaled(call, q, k, v, cu, *, scale, window, sinks):  # exact forward, dK off by 25%
    return call(q, _ScaleGrad.apply(k, 1.25), v, cu, scale=scale, window=window, sinks=sinks)


def _assert_symptom_first(fails: dict, symptom: str):
    wrong = {c.name: d for c, d in fails.items() if not d.startswith(symptom)}
    assert not wrong, f"failures that do not start with {symptom!r}: {wrong}"


def test_window_plus_one_fails_window_cases_with_output_differs(dummy):
    fails = failures(run_conformance(_buggy(dummy[0], "window_plus_one", _window_plus_one), dtype=BUGGY_DTYPE))
    # A window beyond the document cannot tell W from W + 1; every other window case must fail.
    expected = {c for c in ATTENTION_CASES if c.window is not None and c.window < max(c.doc_lens)}
    assert set(fails) == expected
    _assert_symptom_first(fails, "output differs")


def test_window_minus_one_fails_window_cases(dummy):
    fails = failures(run_conformance(_buggy(dummy[0], "window_minus_one", _window_minus_one), dtype=BUGGY_DTYPE))
    assert {c for c in fails} == {c for c in ATTENTION_CASES if c.window is not None and c.window < max(c.doc_lens)}
    _assert_symptom_first(fails, "output differs")


def test_ignored_sinks_fail_sink_cases_output_first_then_missing_dsinks(dummy):
    fails = failures(run_conformance(_buggy(dummy[0], "sinkless", _sinks_ignored), dtype=BUGGY_DTYPE))
    assert set(fails) == {c for c in ATTENTION_CASES if c.sinks is not None}
    _assert_symptom_first(fails, "output differs")
    for detail in fails.values():
        assert "no gradient reached dsinks" in detail
        assert detail.index("output differs") < detail.index("no gradient reached dsinks")


def test_scaled_sinks_fail_sink_cases(dummy):
    fails = failures(run_conformance(_buggy(dummy[0], "sinks_scaled", _sinks_scaled), dtype=BUGGY_DTYPE))
    assert set(fails) == {c for c in ATTENTION_CASES if c.sinks is not None}
    _assert_symptom_first(fails, "output differs")


def test_ignored_scale_fails_the_non_default_scale_cases(dummy):
    fails = failures(run_conformance(_buggy(dummy[0], "scale_ignored", _scale_ignored), dtype=BUGGY_DTYPE))
    assert set(fails) == {c for c in ATTENTION_CASES if c.scale is not None}
    assert len(fails) >= 2
    _assert_symptom_first(fails, "output differs")


def test_wrong_scale_fails_dv_not_d_and_non_default_scale_cases(dummy):
    fails = failures(run_conformance(_buggy(dummy[0], "scale_from_dv", _scale_from_dv), dtype=BUGGY_DTYPE))
    assert set(fails) == {c for c in ATTENTION_CASES if (c.dv is not None and c.dv != c.d) or c.scale is not None}
    _assert_symptom_first(fails, "output differs")


def test_wrong_gqa_head_mapping_fails_grouped_cases(dummy):
    fails = failures(run_conformance(_buggy(dummy[0], "gqa_modulo", _gqa_modulo), dtype=BUGGY_DTYPE))
    assert set(fails) == {c for c in ATTENTION_CASES if c.gqa > 1 and c.hkv > 1}
    _assert_symptom_first(fails, "output differs")


def test_wrong_backward_with_exact_forward_names_dk(dummy):
    fails = failures(run_conformance(_buggy(dummy[0], "dk_scaled", _dk_scaled), dtype=BUGGY_DTYPE))
    # A one-key window without sink has dK = 0 exactly, so scaling it is invisible there; everywhere else not.
    assert set(fails) == {c for c in ATTENTION_CASES if not (c.window == 1 and c.sinks is None)}
    _assert_symptom_first(fails, "dk differs")
    assert not any("output differs" in d for d in fails.values())


def test_fp32_output_for_bf16_inputs_is_a_wrong_output_dtype(dummy):
    fails = failures(run_conformance(_buggy(dummy[0], "fp32_out", _fp32_output), dtype=BUGGY_DTYPE))
    assert set(fails) == set(ATTENTION_CASES)
    _assert_symptom_first(fails, "wrong output dtype: float32, expected bfloat16")


def _last_query_of_later_chunks_misses_itself(doc_start, qs, qe, window):
    lo = doc_start if window is None else max(doc_start, qs - window + 1)
    return lo, qe - 1 if qs > doc_start else qe


def _window_start_late_in_later_chunks(doc_start, qs, qe, window):
    lo = doc_start if window is None else max(doc_start, qs - window + (2 if qs > doc_start else 1))
    return lo, qe


@pytest.mark.parametrize("bug", [_last_query_of_later_chunks_misses_itself, _window_start_late_in_later_chunks])
def test_chunk_boundary_off_by_one_fails_on_long_documents_at_chunk_edges(dummy, monkeypatch, bug):
    backend_cls, attention = dummy
    monkeypatch.setattr(attention, "_key_span", bug)
    fails = failures(run_conformance(backend_cls(), dtype=BUGGY_DTYPE))
    assert fails
    # Only documents longer than a chunk can show it, and the output's worst row is a chunk's first or last row.
    assert all(max(c.doc_lens) > attention.CHUNK for c in fails)
    _assert_symptom_first(fails, "output differs")
    for detail in fails.values():
        where = re.match(r"output differs: .*?worst row .*? at doc \d+ \(len (\d+)\) position (\d+)", detail)
        if where is None:  # rows with nothing visible: "output differs: N non-finite values"
            assert "non-finite" in detail, detail
            continue
        length, position = int(where.group(1)), int(where.group(2))
        assert position % attention.CHUNK in (0, attention.CHUNK - 1) or position == length - 1, detail
    if bug is _last_query_of_later_chunks_misses_itself:  # every case with a document beyond one chunk
        assert set(fails) == {c for c in ATTENTION_CASES if max(c.doc_lens) > attention.CHUNK}


# --- declarations and availability ------------------------------------------------------------------------


class AbsentBackend(CpuBackend):
    name = "absent"
    is_reference = False

    def detect(self) -> Availability:
        return Availability(False, "no such device here")


def test_unavailable_backend_is_not_run_never_passed():
    report = run_conformance(AbsentBackend())
    assert any(c.status == NOT_RUN for c in report.checks)
    assert not report.ok
    assert run_conformance(AbsentBackend(), allow_unavailable=True).ok


def test_unknown_dtype_and_backend_are_refused():
    with pytest.raises(ValueError, match="dtype must be one of"):
        run_conformance("cpu", dtype="float64")
    with pytest.raises(KeyError, match="not registered"):
        run_conformance("no_such_backend")


def test_cases_cover_what_the_contract_promises():
    assert {c.gqa for c in ATTENTION_CASES} >= {1, 2, 4, 8}
    windows = {c.window for c in ATTENTION_CASES}
    assert {None, 1, 31, 32, 33} <= windows
    assert any(c.window is not None and c.window > max(c.doc_lens) for c in ATTENTION_CASES)
    assert any(c.dv is not None and c.dv < c.d for c in ATTENTION_CASES)
    assert any(c.dv is not None and c.dv > c.d for c in ATTENTION_CASES)
    assert sum(c.scale is not None and not math.isclose(c.scale, c.d**-0.5) for c in ATTENTION_CASES) >= 2
    assert any(max(c.doc_lens) >= 300 for c in ATTENTION_CASES)
    assert any(len(c.doc_lens) >= 6 and min(c.doc_lens) == 1 for c in ATTENTION_CASES)  # ragged
    assert any(c.fp32_sinks for c in ATTENTION_CASES) and any(c.sinks and not c.fp32_sinks for c in ATTENTION_CASES)


# --- the log-prob kernel and the declarations -------------------------------------------------------------


class TemperatureIgnored(CpuBackend):
    """A fused log-prob kernel that forgets to divide by the sampling temperature."""

    name = "temperature_ignored"
    is_reference = False

    def logprobs(self, logits, labels, *, chunk_size=1024, temperature=1.0, compute_entropy=True):
        return super().logprobs(logits, labels, chunk_size=chunk_size, temperature=1.0,
                                compute_entropy=compute_entropy)


class LowPrecisionLogprobs(CpuBackend):
    """Returns log-probs in the logits' dtype instead of float32."""

    name = "low_precision_logprobs"
    is_reference = False

    def logprobs(self, logits, labels, **kw):
        lp, ent = super().logprobs(logits, labels, **kw)
        return lp.to(logits.dtype), ent.to(logits.dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_reference_logprobs_kernel_passes(dtype):
    check = logprobs_check(CpuBackend(), dtype)
    assert check.status == PASS, check.detail
    # The kit runs it with the attention cases.
    assert any(c.name == f"logprobs {dtype}" for c in run_conformance("cpu", dtype=dtype, cases=()).checks)


def test_logprobs_kernel_bugs_fail_naming_the_symptom():
    check = logprobs_check(TemperatureIgnored(), "bfloat16")
    assert check.status == FAIL and check.detail.startswith("log-probs differ: rel err")
    check = logprobs_check(LowPrecisionLogprobs(), "bfloat16")
    assert check.status == FAIL and check.detail.startswith("log-probs are bfloat16 [3, 40], expected float32")


class LinearNoEntropyGradient(CpuBackend):
    """A fused lm_head kernel whose entropy carries no gradient (a common shortcut: only log-probs' backward)."""

    name = "linear_no_entropy_grad"
    is_reference = False

    def linear_logprobs(self, hidden, weight, labels, **kw):
        lp, ent = super().linear_logprobs(hidden, weight, labels, **kw)
        return lp, ent.detach()


class LinearBiasDropped(CpuBackend):
    """A fused lm_head kernel that ignores the bias."""

    name = "linear_bias_dropped"
    is_reference = False

    def linear_logprobs(self, hidden, weight, labels, *, bias=None, **kw):
        return super().linear_logprobs(hidden, weight, labels, bias=None, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_reference_linear_logprobs_kernel_passes(dtype):
    check = linear_logprobs_check(CpuBackend(), dtype)
    assert check.status == PASS, check.detail
    assert any(c.name == f"linear_logprobs {dtype}" for c in run_conformance("cpu", dtype=dtype, cases=()).checks)


def test_linear_logprobs_kernel_bugs_fail_naming_the_symptom():
    check = linear_logprobs_check(LinearNoEntropyGradient(), "bfloat16")
    assert check.status == FAIL and check.detail.startswith("hidden gradient differ: rel err"), check.detail
    check = linear_logprobs_check(LinearBiasDropped(), "float32")
    assert check.status == FAIL and check.detail.startswith("log-probs differ"), check.detail
    assert "no bias gradient reached its input" in check.detail


def _declaration(report, name):
    return next(c for c in report.checks if c.name == name)


class UnknownCapability(CpuBackend):
    name = "unknown_capability"
    is_reference = False
    capabilities = frozenset({"bf16", "rollout:hf", "x-private", "flash"})


class DeclaresNativeKernels(CpuBackend):
    name = "declares_native"
    is_reference = False
    native_kernels = frozenset({"varlen_attention", "logprobs"})  # but runs the reference for both


class KernelTypo(CpuBackend):
    name = "kernel_typo"
    is_reference = False
    logprobs_kernel = "polyrl.core.algorithms.logprobs:logprobs_and_entropyy"


class DetectRaises(CpuBackend):
    name = "detect_raises"
    is_reference = False

    def detect(self):
        raise OSError("driver exploded")


def test_declarations_are_checked():
    report = run_conformance(UnknownCapability(), dtype="float32", cases=ATTENTION_CASES[:1])
    check = _declaration(report, "capabilities are in the vocabulary")
    assert check.status == FAIL and check.detail.startswith("unknown: ['flash']")
    report = run_conformance(DeclaresNativeKernels(), dtype="float32", cases=ATTENTION_CASES[:1])
    assert _declaration(report, "native_kernels is derived from the kernel slots").status == FAIL
    assert DeclaresNativeKernels().describe()["kernels_fallback"] == ["varlen_attention", "logprobs",
                                                                      "linear_logprobs", "experts",
                                                                      "decode_attention",
                                                                      "linear_logprob_loss"]  # truthful
    report = run_conformance(KernelTypo(), dtype="float32")
    check = _declaration(report, "kernel paths resolve")
    assert check.status == FAIL and "has no function 'logprobs_and_entropyy'" in check.detail
    assert not report.ok and not kernel_checks(report)  # unusable: its kernels are not run
    report = run_conformance(DetectRaises(), dtype="float32", allow_unavailable=True)
    check = _declaration(report, "detect() returns Availability with a reason when unavailable")
    assert check.status == FAIL and check.detail == "detect() raised OSError: driver exploded"


def test_the_dummy_plugins_declarations_pass(dummy):
    report = run_conformance(dummy[0](), dtype="float32", cases=ATTENTION_CASES[:1])
    assert report.ok, report.format()
    assert dummy[0]().provided_kernels() == frozenset({"varlen_attention"})


# --- the decode attention kernel ----------------------------------------------------------------------------------


def _decode_bug(bug):
    """A CpuBackend whose decode_attention carries one planted bug (the method overridden, as a plugin may)."""

    class Planted(CpuBackend):
        name = f"decode_{bug}"
        is_reference = False

        def decode_attention(self, q, k_cache, v_cache, *, key_padding_mask, scale, window, sinks):
            kw = dict(key_padding_mask=key_padding_mask, scale=scale, window=window, sinks=sinks)
            if bug == "window+1" and window is not None:
                kw["window"] = window + 1
            elif bug == "padding ignored":
                kw["key_padding_mask"] = None
            elif bug == "sinks scaled" and sinks is not None:
                kw["sinks"] = sinks * scale
            elif bug == "top-left aligned":  # queries read as the first Sq slots: the cache cut to Sq keys
                sq = q.shape[1]
                kw["key_padding_mask"] = None if key_padding_mask is None else key_padding_mask[:, :sq]
                return super().decode_attention(q, k_cache[:, :sq], v_cache[:, :sq], **kw)
            elif bug == "float32 output":
                return super().decode_attention(q, k_cache, v_cache, **kw).float()
            return super().decode_attention(q, k_cache, v_cache, **kw)

    return Planted()


def test_the_kit_checks_decode_attention_and_the_reference_passes():
    from polyrl.testing.conformance import DECODE_CASES

    report = run_conformance("cpu", dtype="bfloat16", cases=ATTENTION_CASES[:1])
    decode = [c for c in report.checks if c.name.startswith("decode_attention")]
    assert len(decode) == len(DECODE_CASES) and all(c.status == PASS for c in decode), report.format()


@pytest.mark.parametrize(("bug", "failing", "symptom"), [
    ("window+1", {0}, "output differs"),
    ("padding ignored", {0, 1}, "output differs"),
    ("sinks scaled", {0, 2}, "output differs"),
    ("top-left aligned", {0, 1, 2}, "output differs"),
    ("float32 output", {0, 1, 2}, "wrong output dtype: float32, expected bfloat16"),
])
def test_planted_decode_bugs_fail_the_kit_naming_the_symptom(bug, failing, symptom):
    from polyrl.testing.conformance import DECODE_CASES, decode_checks

    checks = decode_checks(_decode_bug(bug), BUGGY_DTYPE)
    failed = {i for i, c in enumerate(checks) if c.status == FAIL}
    assert failed == failing, [c.detail for c in checks]
    assert all(checks[i].detail.startswith(symptom) for i in failed), [checks[i].detail for i in failed]
    assert len(checks) == len(DECODE_CASES)


def test_a_query_on_padding_that_is_not_zero_is_named():
    from polyrl.testing.conformance import DECODE_CASES, decode_check

    class LeaksPadding(CpuBackend):
        name = "decode_leak"
        is_reference = False

        def decode_attention(self, q, k_cache, v_cache, *, key_padding_mask, scale, window, sinks):
            out = super().decode_attention(q, k_cache, v_cache, key_padding_mask=key_padding_mask, scale=scale,
                                           window=window, sinks=sinks)
            return out + 1e-2 * (out == 0)  # rows with nothing visible are no longer zeros

    check = decode_check(LeaksPadding(), DECODE_CASES[1], "float32")  # row 1's first query sits on padding
    assert check.status == FAIL and "row 1 query 0 (cache slot 10)" in check.detail
    assert "a query that sees no key must return zeros" in check.detail


# --- device_graph --------------------------------------------------------------------------------------------
class _GraphStandIn(CpuBackend):
    """A cpu backend declaring a device graph: ``mode`` picks a correct stand-in (replay = run the step again) or
    one of the mistakes the check must name."""

    name = "graph-stand-in"

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def device_graph(self):
        mode = self.mode

        def capture(step, before_capture=None):
            if mode != "no-warm-up":
                step()
            if before_capture is not None and mode != "no-before":
                before_capture()
            if mode == "runs-at-capture":
                step()
            if mode == "replay-does-nothing":
                return lambda: None
            return step
        return capture


def test_device_graph_check() -> None:
    from polyrl.testing.conformance import device_graph_check

    assert device_graph_check(CpuBackend()).status == "pass"  # none declared
    assert device_graph_check(_GraphStandIn("ok")).status == "pass"
    for mode, symptom in (("no-warm-up", "before_capture saw [0.0]"), ("no-before", "before_capture saw []"),
                          ("runs-at-capture", "the capture ran the step"),
                          ("replay-does-nothing", "replays gave (x, y) = (0.0, 0.0)")):
        check = device_graph_check(_GraphStandIn(mode))
        assert check.status == "fail" and symptom in check.detail, (mode, check.detail)
