"""Conformance kit for backend plugin authors.

A backend is conformant when it declares what docs/plugins.md asks for and its attention kernel meets the
contract of docs/plugins.md ("The kernel contract") on every case of :data:`ATTENTION_CASES`, within the
bars of :mod:`polyrl.core.tolerances` (and its decode attention kernel, forward only, on every case of
:data:`DECODE_CASES`). Use it from your plugin's test suite::

    from polyrl.testing.conformance import run_conformance
    def test_my_backend_conforms():
        for dtype in ("float32", "bfloat16"):
            report = run_conformance("mybackend", dtype=dtype)
            assert report.ok, report.format()

How a case is judged: the inputs are drawn in fp32, rounded to the dtype under test, and given both to the
backend (on its device) and to the fp64 dense oracle of :mod:`polyrl.testing.attention_oracle`; a correct
kernel's error is then only its own arithmetic and the rounding of its results, never the rounding of its
inputs. Each of out, dq, dk, dv (and dsinks) is checked for presence, shape, dtype, finiteness, a relative
norm error (diffuse errors: a scale slightly off) and the worst row's error (local errors: one query at a
chunk edge seeing one key too many). A failure names the symptom first — "output differs" before "no
gradient reached dsinks" — then where the worst row is (document, position, head).

Checks that need the backend's hardware are reported as ``not run`` (never as passed) when ``detect()`` says
the backend is not available; ``report.ok`` is then False unless ``allow_unavailable=True`` is passed, so a
CI that lacks the device cannot mistake silence for success. ``polyrl parity --level op`` runs the same cases.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from typing import TYPE_CHECKING, Any

from polyrl.core.plugins import list_backends
from polyrl.core.plugins.backend import (
    CAPABILITIES,
    Availability,
    Backend,
    ShardingPolicy,
    one_line,
    unknown_capabilities,
)

if TYPE_CHECKING:
    import torch

PASS, FAIL, NOT_RUN = "pass", "fail", "not run"
DTYPES = ("float32", "bfloat16", "float16")
RESULTS = ("out", "dq", "dk", "dv", "dsinks")
# DeepSeek-V3 scales its logits by mscale**2 / sqrt(D) (YaRN, factor 40): a kernel must use the caller's scale.
YARN_MSCALE = 0.1 * math.log(40.0) + 1.0


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One varlen_attention case: packed documents, heads, head dims, window, sinks and scale."""

    name: str
    doc_lens: tuple[int, ...]
    hkv: int = 2
    gqa: int = 1  # query heads per key/value head
    d: int = 32
    dv: int | None = None  # None: Dv = D
    window: int | None = None
    sinks: float | None = None  # standard deviation of the random per-head sinks; None: no sinks
    scale: float | None = None  # None: the default D ** -0.5 (varlen_attention fills it in)
    fp32_sinks: bool = False  # sinks in fp32 whatever the dtype under test (else in q's dtype)
    seed: int = 0

    @property
    def hq(self) -> int:
        return self.hkv * self.gqa

    @property
    def head_dim_v(self) -> int:
        return self.d if self.dv is None else self.dv

    def label(self) -> str:
        docs = ",".join(map(str, self.doc_lens))
        parts = [f"docs=[{docs}]", f"heads={self.hq}/{self.hkv}", f"D={self.d}"]
        if self.dv is not None:
            parts.append(f"Dv={self.dv}")
        parts += [f"window={self.window}", f"sinks={self.sinks}"]
        if self.scale is not None:
            parts.append(f"scale={self.scale:.4g}")
        return f"{self.name} ({' '.join(parts)})"


# THE one list of attention cases: the conformance kit and `polyrl parity --level op` both run it.
# Windows run from 1 to beyond the document and sit on both sides of 32-query chunk edges; GQA ratios
# 1, 2, 4, 8; documents from 1 to 512 tokens, alone and in ragged batches; Dv != D both ways; a
# non-default scale (DeepSeek-V3's YaRN mscale) alone and with window and sinks; sinks in q's dtype and
# in fp32, weak and strong. Sized so the whole list runs in a few seconds on two CPU cores.
ATTENTION_CASES: tuple[AttentionCase, ...] = (
    AttentionCase("ragged short documents", (1, 5, 17, 2, 1, 9), seed=1),
    AttentionCase("ragged short documents, sinks", (1, 5, 17, 2, 1, 9), gqa=2, sinks=1.0, seed=2),
    AttentionCase("window 1", (1, 7, 70), window=1, seed=3),
    AttentionCase("window 1, sinks", (3, 70), gqa=4, window=1, sinks=1.0, seed=4),
    AttentionCase("window 2, fp32 sinks", (5, 40), gqa=2, window=2, sinks=2.0, fp32_sinks=True, seed=5),
    AttentionCase("window 31", (300, 3), gqa=2, window=31, sinks=1.0, seed=6),
    AttentionCase("window 32", (130, 66), window=32, seed=7),
    AttentionCase("window 33", (257,), gqa=4, window=33, sinks=1.0, seed=8),
    AttentionCase("window 100, strong sinks", (300, 1, 45), hkv=1, gqa=8, window=100, sinks=5.0, seed=9),
    AttentionCase("window beyond the document", (200, 17), gqa=2, window=1000, sinks=1.0, seed=10),
    AttentionCase("long document", (512,), hkv=1, gqa=8, seed=11),
    AttentionCase("long ragged batch", (1, 300, 2, 97, 33, 64, 1), gqa=4, sinks=1.0, seed=12),
    AttentionCase("non-default scale, Dv < D", (150, 40, 1), gqa=4, d=48, dv=32,
                  scale=YARN_MSCALE**2 / math.sqrt(48), seed=13),
    AttentionCase("non-default scale, window, sinks", (100, 64), gqa=2, window=40, sinks=1.0, scale=0.5, seed=14),
    AttentionCase("Dv > D, window 16", (65, 33), hkv=1, gqa=8, d=24, dv=40, window=16, sinks=1.0, seed=15),
)


# --- running a case ---------------------------------------------------------------------------------------


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


def case_inputs(case: AttentionCase, dtype: str) -> dict[str, Any]:
    """q, k, v, sinks (or None), d_out in ``dtype`` (sinks in fp32 when the case says so), cu_seqlens int32."""
    import torch

    dt = _torch_dtype(dtype)
    gen = torch.Generator().manual_seed(case.seed)
    t = sum(case.doc_lens)
    q = torch.randn(t, case.hq, case.d, generator=gen)
    k = torch.randn(t, case.hkv, case.d, generator=gen)
    v = torch.randn(t, case.hkv, case.head_dim_v, generator=gen)
    d_out = torch.randn(t, case.hq, case.head_dim_v, generator=gen)
    sinks = None if case.sinks is None else case.sinks * torch.randn(case.hq, generator=gen)
    cu = torch.tensor([0, *itertools.accumulate(case.doc_lens)], dtype=torch.int32)
    return {"q": q.to(dt), "k": k.to(dt), "v": v.to(dt), "d_out": d_out.to(dt), "cu_seqlens": cu,
            "sinks": None if sinks is None else sinks.to(torch.float32 if case.fp32_sinks else dt)}


@functools.lru_cache(maxsize=64)
def oracle_results(case: AttentionCase, dtype: str) -> dict[str, Any]:
    """fp64 out and gradients of the case's (rounded) inputs, plus the dQ/dK rows' cancellation floors."""
    from polyrl.testing.attention_oracle import dense_attention_fp64, gradient_floors_fp64

    x = case_inputs(case, dtype)
    scale = case.d**-0.5 if case.scale is None else case.scale
    names = ["q", "k", "v"] + (["sinks"] if x["sinks"] is not None else [])
    leaves = {n: x[n].double().requires_grad_() for n in names}
    out = dense_attention_fp64(leaves["q"], leaves["k"], leaves["v"], x["cu_seqlens"], scale=scale,
                               window=case.window, sinks=leaves.get("sinks"))
    out.backward(x["d_out"].double())
    fq, fk = gradient_floors_fp64(x["q"], x["k"], x["v"], x["cu_seqlens"], x["d_out"], scale=scale,
                                  window=case.window, sinks=x["sinks"])
    results = {"out": out.detach(), **{f"d{n}": leaves[n].grad for n in names}}
    return {"results": results, "floors": {"dq": fq, "dk": fk}}


@dataclasses.dataclass
class TensorCheck:
    """One result tensor of a case (out, dq, dk, dv or dsinks) against the oracle."""

    name: str
    present: bool = True
    dtype: str = ""
    expected_dtype: str = ""
    shape: tuple[int, ...] = ()
    expected_shape: tuple[int, ...] = ()
    nonfinite: int = 0
    error: float | None = None  # relative norm error
    bar: float | None = None
    row_error: float | None = None  # worst row's error
    row_bar: float | None = None
    worst_row: str = ""  # where the worst row is

    @property
    def what(self) -> str:
        return "output" if self.name == "out" else self.name

    @property
    def differs(self) -> bool:
        return self.nonfinite > 0 or not (self.error is not None and self.error <= self.bar) or not (
            self.row_error is None or self.row_error <= self.row_bar)

    @property
    def ok(self) -> bool:
        return (self.present and self.shape == self.expected_shape and self.dtype == self.expected_dtype
                and not self.differs)

    def symptoms(self) -> list[str]:
        """What is wrong, most visible first: missing, shape, dtype, then values."""
        if not self.present:
            return [f"no gradient reached {self.name}" if self.name != "out" else "no output"]
        if self.shape != self.expected_shape:
            return [f"{self.what} has shape {list(self.shape)}, expected {list(self.expected_shape)}"]
        found = []
        if self.dtype != self.expected_dtype:
            source = "the inputs'" if self.name == "out" else f"{self.name[1:]}'s"
            found.append(f"wrong {self.what} dtype: {self.dtype}, expected {self.expected_dtype} ({source} dtype)")
        if self.nonfinite:
            found.append(f"{self.what} differs: {self.nonfinite} non-finite values")
        elif self.differs:
            norm = f"rel err {self.error:.1e} (bar {self.bar:.1e})"
            row = "" if self.row_error is None else f"worst row {self.row_error:.1e} (bar {self.row_bar:.1e}) at {self.worst_row}"
            found.append(f"{self.what} differs: {norm}" + (f", {row}" if row else ""))
        return found


@dataclasses.dataclass
class CaseResult:
    case: AttentionCase
    dtype: str
    tensors: list[TensorCheck]
    raised: str = ""  # the kernel raised: "TypeError: ..."

    @property
    def ok(self) -> bool:
        return not self.raised and all(t.ok for t in self.tensors)

    def symptoms(self) -> list[str]:
        if self.raised:
            return [f"kernel raised {self.raised}"]
        return [s for t in self.tensors for s in t.symptoms()]

    def summary(self) -> str:
        """Errors of every result beside the bars, in the order out/dq/dk/dv/dsinks."""
        ran = [t for t in self.tensors if t.error is not None]
        if not ran:
            return ""

        def join(values, fmt="{:.1e}"):
            return "/".join("-" if x is None else fmt.format(x) for x in values)

        names = "/".join(t.name for t in ran)
        return (f"rel err {names} = {join(t.error for t in ran)} (bars {join(t.bar for t in ran)}); "
                f"worst row {join(t.row_error for t in ran)} (bars {join(t.row_bar for t in ran)})")

    def detail(self) -> str:
        symptoms = self.symptoms()
        summary = self.summary()
        if not symptoms:
            return summary
        return "; ".join(symptoms) + (f" | {summary}" if summary else "")


def _where(flat_row: int, heads: int, cu: list[int]) -> str:
    token, head = divmod(flat_row, heads)
    doc = bisect.bisect_right(cu, token) - 1  # the last document starting at or before token: never empty
    return f"doc {doc} (len {cu[doc + 1] - cu[doc]}) position {token - cu[doc]} head {head}"


def _compare(name: str, got, expected, expected_dtype, floor, dtype: str, cu: list[int]) -> TensorCheck:
    import torch

    from polyrl.core.tolerances import relative_error, tolerance

    check = TensorCheck(name, expected_dtype=str(expected_dtype).removeprefix("torch."),
                        expected_shape=tuple(expected.shape))
    if got is None:
        check.present = False
        return check
    check.dtype = str(got.dtype).removeprefix("torch.")
    check.shape = tuple(got.shape)
    if check.shape != check.expected_shape:
        return check
    a = got.detach().to("cpu", torch.float64)
    e = expected.detach().to(torch.float64)
    check.nonfinite = int((~torch.isfinite(a)).sum())
    kind = {"out": "attention.forward", "dsinks": "attention.dsinks"}.get(name, "attention.grad")
    check.bar = tolerance(kind, dtype)
    if check.nonfinite:
        return check
    if name == "dsinks":  # one number per head: the norm error is the whole story
        check.error = relative_error(a, e)
        return check
    check.row_bar = tolerance(kind + ".row", dtype)
    rows_a, rows_e = a.reshape(-1, a.shape[-1]), e.reshape(-1, e.shape[-1])
    den = rows_e.norm(dim=-1)  # each row against its own size, or the size of what cancels in it
    if floor is not None:
        den = torch.maximum(den, floor.reshape(-1))
    num = (rows_a - rows_e).norm(dim=-1)
    total = den.norm().item()
    check.error = num.norm().item() / total if total > 0 else num.norm().item()
    ratio = torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float64).tiny),
                        torch.where(num > 0, torch.inf, 0.0))
    worst = int(ratio.argmax())
    check.row_error = float(ratio[worst])
    check.worst_row = _where(worst, a.shape[1], cu)
    return check


def run_attention_case(backend: str | Backend, case: AttentionCase, dtype: str) -> CaseResult:
    """Forward and backward of ``case`` on ``backend`` in ``dtype``, judged against the fp64 oracle."""
    from polyrl.core.attention import varlen_attention

    if isinstance(backend, str):
        from polyrl.core.plugins import resolve_backend

        backend = resolve_backend(backend)
    x = case_inputs(case, dtype)
    oracle = oracle_results(case, dtype)
    device = backend.device(0)
    names = ["q", "k", "v"] + (["sinks"] if x["sinks"] is not None else [])
    leaves = {n: x[n].detach().to(device).clone().requires_grad_() for n in names}
    try:
        out = varlen_attention(leaves["q"], leaves["k"], leaves["v"], x["cu_seqlens"].to(device),
                               scale=case.scale, window=case.window, sinks=leaves.get("sinks"), backend=backend)
        got = {"out": out}
        if tuple(out.shape) == tuple(oracle["results"]["out"].shape) and out.requires_grad:
            out.backward(x["d_out"].to(device, out.dtype))
            got.update({f"d{n}": leaves[n].grad for n in names})
    except Exception as exc:  # a kit reports a crashing kernel; it does not crash with it
        return CaseResult(case, dtype, [], raised=f"{type(exc).__name__}: {exc}".splitlines()[0])
    if tuple(out.shape) != tuple(oracle["results"]["out"].shape):  # nothing else can be compared
        names = []
    cu = x["cu_seqlens"].tolist()
    expected_dtypes = {"out": x["q"].dtype, **{f"d{n}": x[n].dtype for n in names}}
    tensors = [_compare(name, got.get(name), oracle["results"][name], expected_dtypes[name],
                        oracle["floors"].get(name), dtype, cu)
               for name in RESULTS if name in expected_dtypes]
    return CaseResult(case, dtype, tensors)


# --- the kit ----------------------------------------------------------------------------------------------


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
    dtype: str = "float32"
    results: list[CaseResult] = dataclasses.field(default_factory=list)  # one per attention case that ran

    @property
    def ok(self) -> bool:
        bad = {FAIL} if self.allow_unavailable else {FAIL, NOT_RUN}
        return not any(c.status in bad for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    def format(self) -> str:
        return "\n".join(f"[{c.status:>7}] {self.backend}: {c.name}: {c.detail}".rstrip(": ") for c in self.checks)

    def worst_errors(self) -> dict[str, float]:
        """The worst of each measure over the cases, keyed like the tolerance table ("forward.row", ...)."""
        return worst_errors(self.results)


def worst_errors(results: list[CaseResult]) -> dict[str, float]:
    worst: dict[str, float] = {}
    for result in results:
        for t in result.tensors:
            what = {"out": "forward", "dsinks": "dsinks"}.get(t.name, "grad")
            for key, err in ((what, t.error), (what + ".row", t.row_error)):
                if err is not None:
                    worst[key] = max(worst.get(key, 0.0), err)
    return worst


def _check(name: str, ok: bool, detail: str = "") -> Check:
    return Check(name, PASS if ok else FAIL, detail)


def _declaration_checks(backend: Backend) -> list[Check]:
    """What the class declares, checked without running a kernel (docs/plugins.md, "Declarations")."""
    from polyrl.core import compat
    from polyrl.core.plugins import get_registry

    checks = []
    for attr, kind in (("name", str), ("device_type", str), ("collective_backend", str)):
        value = getattr(backend, attr, None)
        checks.append(_check(f"declares {attr}", isinstance(value, kind) and bool(value), repr(value)))
    flags = (backend.is_accelerator, backend.is_reference)
    checks.append(_check("is_accelerator / is_reference are booleans, not both true",
                         all(isinstance(f, bool) for f in flags) and not all(flags),
                         f"is_accelerator={flags[0]!r} is_reference={flags[1]!r}"))
    unknown = unknown_capabilities(frozenset(backend.capabilities))
    checks.append(_check("capabilities are in the vocabulary", not unknown,
                         f"unknown: {unknown} (known: {sorted(CAPABILITIES)}, rollout:<engine>, x-<private>)"
                         if unknown else ""))
    engines = get_registry().rollout_engines
    missing = [e for e in backend.rollout_engines if e not in engines]
    checks.append(_check("rollout engines are registered", not missing,
                         f"not registered: {missing} (registered: {sorted(engines)})" if missing else ""))
    # A class that still declares native_kernels (overriding the base class's deprecated alias) must agree with
    # its slots; reading the alias itself would only warn.
    declares = getattr(type(backend), "native_kernels", None) is not Backend.__dict__["native_kernels"]
    provided = backend.provided_kernels()
    declared = getattr(backend, "native_kernels", None) if declares else provided
    checks.append(_check("native_kernels is derived from the kernel slots", declared == provided,
                         "" if declared == provided else
                         f"the class declares native_kernels={sorted(declared or ())} but provides {sorted(provided)}: "
                         "remove the declaration, set attention_kernel / logprobs_kernel instead"))
    try:
        avail = backend.detect()
        detail = repr(avail)
    except Exception as exc:
        avail, detail = None, f"detect() raised {one_line(exc)}"
    checks.append(_check("detect() returns Availability with a reason when unavailable",
                         isinstance(avail, Availability) and (avail.available or bool(avail.reason)), detail))
    # The kernel modules are imported only where the backend can run (vendor modules are importable there).
    problems = backend.declaration_problems(resolve=isinstance(avail, Availability) and avail.available)
    checks.append(_check("kernel paths resolve", not problems, "; ".join(problems)))
    policy = backend.sharding_policy()
    ok = isinstance(policy, ShardingPolicy) and {policy.param_dtype, policy.reduce_dtype} <= set(DTYPES)
    checks.append(_check("sharding policy uses known dtypes", ok, repr(policy)))
    try:
        rows = backend.compatibility()
        if not isinstance(rows, compat.Compatibility):
            raise TypeError(f"returned {type(rows).__name__}, not a polyrl.core.compat.Compatibility")
        env = compat.read_environment(compat.CORE_COMPONENTS + tuple(rows.components), rows.facts)
        compat.check(env, tuple(rows.rules))
        checks.append(_check("compatibility() rows run", True))
    except Exception as exc:
        checks.append(_check("compatibility() rows run", False, one_line(exc)))
    describe = backend.describe()
    checks.append(_check("describe() lists fallbacks", "kernels_fallback" in describe))
    return checks


# --- the log-prob kernel ----------------------------------------------------------------------------------
LOGPROBS_SHAPE = (3, 40, 97)  # [batch, T, V]: several chunks of LOGPROBS_CHUNK rows, a vocabulary not a power of 2
LOGPROBS_CHUNK, LOGPROBS_TEMPERATURE = 16, 0.7


def logprobs_check(backend: Backend, dtype: str) -> Check:
    """``backend.logprobs`` against fp64 log_softmax on logits rounded to ``dtype``: log-probs and entropies in
    float32 of the labels' shape, the gradient of a weighted sum of both in the logits' dtype, and the
    ``compute_entropy=False`` path giving the same log-probs."""
    import torch

    from polyrl.core.tolerances import relative_error, tolerance

    dt = _torch_dtype(dtype)
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(*LOGPROBS_SHAPE, generator=gen)).to(dt)
    labels = torch.randint(0, LOGPROBS_SHAPE[-1], LOGPROBS_SHAPE[:-1], generator=gen)
    w_lp, w_ent = torch.randn(LOGPROBS_SHAPE[:-1], generator=gen), torch.randn(LOGPROBS_SHAPE[:-1], generator=gen)
    x = logits.double().requires_grad_()
    logsm = torch.log_softmax(x / LOGPROBS_TEMPERATURE, -1)
    exp_lp, exp_ent = logsm.gather(-1, labels[..., None])[..., 0], -(logsm.exp() * logsm).sum(-1)
    (w_lp * exp_lp + w_ent * exp_ent).sum().backward()
    device = backend.device(0)
    y = logits.to(device).requires_grad_()
    kw = {"chunk_size": LOGPROBS_CHUNK, "temperature": LOGPROBS_TEMPERATURE}
    name = f"logprobs {dtype}"
    try:
        lp, ent = backend.logprobs(y, labels.to(device), compute_entropy=True, **kw)
        (w_lp.to(device) * lp + w_ent.to(device) * ent).sum().backward()
        lp_only, _ = backend.logprobs(y.detach(), labels.to(device), compute_entropy=False, **kw)
    except Exception as exc:
        return Check(name, FAIL, f"kernel raised {one_line(exc)}")
    symptoms = []
    for what, got in (("log-probs", lp), ("entropies", ent), ("log-probs without entropy", lp_only)):
        if tuple(got.shape) != tuple(labels.shape) or got.dtype != torch.float32:
            symptoms.append(f"{what} are {str(got.dtype).removeprefix('torch.')} {list(got.shape)}, expected "
                            f"float32 {list(labels.shape)}")
    if symptoms:
        return Check(name, FAIL, "; ".join(symptoms))
    errors = []
    for what, got, exp, key in (("log-probs", lp, exp_lp, "algorithms.logprobs"),
                                ("entropies", ent, exp_ent, "algorithms.logprobs"),
                                ("log-probs without entropy", lp_only, exp_lp, "algorithms.logprobs"),
                                ("gradient", y.grad, x.grad, "algorithms.logprobs_grad")):
        if got is None:
            symptoms.append("no gradient reached the logits")
            continue
        err, bar = relative_error(got.cpu(), exp.detach()), tolerance(key, dtype)
        errors.append(f"{what} {err:.1e} (bar {bar:.1e})")
        if not err <= bar:
            symptoms.append(f"{what} differ: rel err {err:.1e} (bar {bar:.1e})")
    if y.grad is not None and y.grad.dtype != dt:
        symptoms.insert(0, f"wrong gradient dtype: {str(y.grad.dtype).removeprefix('torch.')}, expected {dtype}")
    return Check(name, FAIL if symptoms else PASS, "; ".join(symptoms) + (" | " if symptoms else "") +
                 "rel err " + ", ".join(errors))


# --- the fused lm_head + log-prob kernel -------------------------------------------------------------------------
# [T, H] hidden states, [V, H] weight: T is not a multiple of the token chunk, V is not one of the vocab chunk, and
# V is above the chunk so that an online log-sum-exp over vocabulary blocks is exercised.
LINEAR_SHAPE = (37, 24, 203)  # T, H, V
LINEAR_CHUNK = 16


@dataclasses.dataclass
class _LinearOracle:
    """The inputs of a fused lm_head check (``dtype``-valued hidden [T, H], weight [V, H], bias [V], labels, the
    loss's per-token weights) and, in fp64 through the full logits, their log-probs, entropies and the gradients of
    Σ w_lp·logp + Σ w_ent·H."""

    inputs: list
    labels: Any
    w_lp: Any
    w_ent: Any
    exp_lp: Any
    exp_ent: Any
    ref: list


def _linear_oracle(dtype: str, seed: int) -> _LinearOracle:
    import torch

    dt = _torch_dtype(dtype)
    T, H, V = LINEAR_SHAPE
    gen = torch.Generator().manual_seed(seed)
    inputs = [(2 * torch.randn(T, H, generator=gen)).to(dt), (torch.randn(V, H, generator=gen) / H**0.5).to(dt),
              (0.5 * torch.randn(V, generator=gen)).to(dt)]
    labels = torch.randint(0, V, (T,), generator=gen)
    w_lp, w_ent = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
    ref = [t.double().requires_grad_() for t in inputs]
    logsm = torch.log_softmax((ref[0] @ ref[1].t() + ref[2]) / LOGPROBS_TEMPERATURE, -1)
    exp_lp, exp_ent = logsm.gather(-1, labels[:, None])[:, 0], -(logsm.exp() * logsm).sum(-1)
    (w_lp * exp_lp + w_ent * exp_ent).sum().backward()
    return _LinearOracle(inputs, labels, w_lp, w_ent, exp_lp, exp_ent, ref)


def _linear_verdict(name: str, dtype: str, oracle: _LinearOracle, got: list, values: list[tuple[str, Any]],
                    symptoms: list[str]) -> Check:
    """Compare ``values`` ((what, float32 [T] output) against the oracle's log-probs, or entropies where ``what``
    names them) and the gradients on the ``got`` leaves with the oracle's, each to its bar; ``symptoms`` so far."""
    import torch

    from polyrl.core.tolerances import relative_error, tolerance

    T = LINEAR_SHAPE[0]
    for what, out in values:
        if tuple(out.shape) != (T,) or out.dtype != torch.float32:
            symptoms.append(f"{what} are {str(out.dtype).removeprefix('torch.')} {list(out.shape)}, expected "
                            f"float32 [{T}]")
    if symptoms:
        return Check(name, FAIL, "; ".join(symptoms))
    errors = []
    pairs = [(what, out, oracle.exp_ent if what == "entropies" else oracle.exp_lp, "algorithms.linear_logprobs")
             for what, out in values]
    pairs += [(f"{what} gradient", g.grad, r.grad, "algorithms.linear_logprobs_grad")
              for what, g, r in zip(("hidden", "weight", "bias"), got, oracle.ref)]
    for what, out, exp, key in pairs:
        if out is None:
            symptoms.append(f"no {what} reached its input")
            continue
        err, bar = relative_error(out.detach().cpu(), exp.detach()), tolerance(key, dtype)
        errors.append(f"{what} {err:.1e} (bar {bar:.1e})")
        if not err <= bar:
            symptoms.append(f"{what} differ: rel err {err:.1e} (bar {bar:.1e})")
    dt = _torch_dtype(dtype)
    wrong = [what for what, g in zip(("hidden", "weight", "bias"), got) if g.grad is not None and g.grad.dtype != dt]
    if wrong:
        symptoms.insert(0, f"wrong gradient dtype for {', '.join(wrong)}: expected {dtype}")
    return Check(name, FAIL if symptoms else PASS, "; ".join(symptoms) + (" | " if symptoms else "") +
                 "rel err " + ", ".join(errors))


def linear_logprobs_check(backend: Backend, dtype: str) -> Check:
    """``backend.linear_logprobs`` against fp64 log_softmax of the full logits of the same ``dtype``-valued
    hidden states, weight and bias: log-probs, entropies (float32 [T]) and the gradients of hidden, weight and
    bias of a weighted sum of both, in their inputs' dtypes; ``compute_entropy=False`` gives the same log-probs."""
    oracle = _linear_oracle(dtype, seed=1)
    device = backend.device(0)
    got = [t.to(device).requires_grad_() for t in oracle.inputs]
    kw = {"chunk_size": LINEAR_CHUNK, "temperature": LOGPROBS_TEMPERATURE}
    name = f"linear_logprobs {dtype}"
    try:
        lp, ent = backend.linear_logprobs(got[0], got[1], oracle.labels.to(device), bias=got[2],
                                          compute_entropy=True, **kw)
        (oracle.w_lp.to(device) * lp + oracle.w_ent.to(device) * ent).sum().backward()
        lp_only, _ = backend.linear_logprobs(got[0].detach(), got[1].detach(), oracle.labels.to(device),
                                             bias=got[2].detach(), compute_entropy=False, **kw)
    except Exception as exc:
        return Check(name, FAIL, f"kernel raised {one_line(exc)}")
    return _linear_verdict(name, dtype, oracle, got, [("log-probs", lp), ("entropies", ent),
                                                      ("log-probs without entropy", lp_only)], [])


def linear_logprob_loss_check(backend: Backend, dtype: str) -> Check:
    """``backend.linear_logprob_loss`` with a ``token_grad`` of fixed per-token weights (the loss
    Σ w_lp·logp + Σ w_ent·H, the one ``linear_logprobs_check`` differentiates) against fp64 through the full logits:
    log-probs, entropies, and the gradients the anchor carries to hidden, weight and bias; every row handed to
    ``token_grad`` exactly once, in order."""
    oracle = _linear_oracle(dtype, seed=2)
    device = backend.device(0)
    got = [t.to(device).requires_grad_() for t in oracle.inputs]
    rows: list[int] = []

    def token_grad(t0: int, t1: int, lp: Any, ent: Any) -> tuple[Any, Any]:
        rows.extend(range(t0, t1))
        return oracle.w_lp[t0:t1].to(lp.device, lp.dtype), oracle.w_ent[t0:t1].to(lp.device, lp.dtype)

    name = f"linear_logprob_loss {dtype}"
    try:
        anchor, lp, ent = backend.linear_logprob_loss(got[0], got[1], oracle.labels.to(device), token_grad,
                                                      bias=got[2], chunk_size=LINEAR_CHUNK,
                                                      temperature=LOGPROBS_TEMPERATURE)
        anchor.backward()
    except Exception as exc:
        return Check(name, FAIL, f"kernel raised {one_line(exc)}")
    T = LINEAR_SHAPE[0]
    symptoms = [] if rows == list(range(T)) else [
        f"token_grad saw rows {rows[:8]}... ({len(rows)}), expected each of 0..{T - 1} once, in order"]
    return _linear_verdict(name, dtype, oracle, got, [("log-probs", lp), ("entropies", ent)], symptoms)


# --- the decode attention kernel (generation form) -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decode_attention case: ``batch`` rows of ``q_len`` queries at the end of a ``cache_len``-slot KV cache."""

    name: str
    batch: int
    q_len: int
    cache_len: int
    pads: tuple[int, ...] | None = None  # left-padded slots of each row; None: no key padding mask
    hkv: int = 2
    gqa: int = 1
    d: int = 32
    dv: int | None = None
    window: int | None = None
    sinks: float | None = None  # standard deviation of the random per-head sinks (in q's dtype); None: no sinks
    scale: float | None = None
    seed: int = 0

    def label(self) -> str:
        parts = [f"B={self.batch} Sq={self.q_len} Sk={self.cache_len}", f"pads={list(self.pads or [])}",
                 f"heads={self.hkv * self.gqa}/{self.hkv}", f"D={self.d}"]
        if self.dv is not None:
            parts.append(f"Dv={self.dv}")
        parts += [f"window={self.window}", f"sinks={self.sinks}"]
        if self.scale is not None:
            parts.append(f"scale={self.scale:.4g}")
        return f"{self.name} ({' '.join(parts)})"


# The generation form's cases (docs/plugins.md, "decode attention"): left padding of different amounts per row, a
# query sitting on padding (it sees no key: zeros), windows inside and beyond the cache, sinks, GQA 1 / 4 / 8, Dv != D
# both ways with head dims that are not powers of two, a non-default scale. Small: a few milliseconds on the CPU.
DECODE_CASES: tuple[DecodeCase, ...] = (
    DecodeCase("decode step, ragged left padding, window 3, sinks", 3, 1, 21, pads=(0, 4, 20), gqa=4, window=3,
               sinks=1.0, seed=21),
    DecodeCase("several queries, one on padding, Dv < D, non-default scale", 2, 3, 13, pads=(0, 11), d=48, dv=32,
               scale=YARN_MSCALE**2 / math.sqrt(48), seed=22),
    DecodeCase("no mask, window beyond the cache, Dv > D", 2, 2, 40, hkv=1, gqa=8, d=24, dv=40, window=1000,
               sinks=1.0, seed=23),
)


def decode_oracle_fp64(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor | None, *,
                       scale: float, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Dense fp64 decode attention (the contract, written plainly): [B, Sq, Hq, Dv]; zeros where nothing is seen."""
    import torch

    _, sq, hq, _ = q.shape
    sk, hkv = k_cache.shape[1], k_cache.shape[2]
    k = k_cache.double().repeat_interleave(hq // hkv, dim=2)  # query head h reads kv head h // G
    v = v_cache.double().repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k) * scale  # [B, Hq, Sq, Sk]
    qpos = torch.arange(sk - sq, sk)[:, None]
    kpos = torch.arange(sk)[None, :]
    seen = (kpos <= qpos) & ((qpos - kpos < window) if window is not None else True)
    seen = seen[None, None] & (mask[:, None, None, :] if mask is not None else True)
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.double()[None, :, None, None])
    lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.einsum("bhij,bjhd->bihd", torch.exp(s - lse), v)


def decode_check(backend: Backend, case: DecodeCase, dtype: str) -> Check:
    """``decode_attention`` on ``backend`` (its ``decode_attention_kernel``, without gradients, as the hf engine calls
    it) against the fp64 oracle on the same ``dtype``-rounded inputs: shape, dtype, finiteness, the attention forward
    bars (relative norm error and worst (row, query, head) vector), and exact zeros where a query sees no key."""
    import torch

    from polyrl.core.attention import decode_attention
    from polyrl.core.tolerances import tolerance

    dt = _torch_dtype(dtype)
    gen = torch.Generator().manual_seed(case.seed)
    hq, dv = case.hkv * case.gqa, case.d if case.dv is None else case.dv
    q = torch.randn(case.batch, case.q_len, hq, case.d, generator=gen).to(dt)
    k = torch.randn(case.batch, case.cache_len, case.hkv, case.d, generator=gen).to(dt)
    v = torch.randn(case.batch, case.cache_len, case.hkv, dv, generator=gen).to(dt)
    sinks = None if case.sinks is None else (case.sinks * torch.randn(hq, generator=gen)).to(dt)
    mask = None if case.pads is None else torch.arange(case.cache_len)[None, :] >= torch.tensor(case.pads)[:, None]
    scale = case.d**-0.5 if case.scale is None else case.scale
    expected = decode_oracle_fp64(q, k, v, mask, scale=scale, window=case.window, sinks=sinks)
    name = f"decode_attention {case.label()} {dtype}"
    device = backend.device(0)
    on = [None if x is None else x.to(device) for x in (q, k, v, mask, sinks)]
    try:
        with torch.no_grad():
            out = decode_attention(on[0], on[1], on[2], key_padding_mask=on[3], scale=case.scale, window=case.window,
                                   sinks=on[4], backend=backend)
    except Exception as exc:  # a kit reports a crashing kernel; it does not crash with it
        return Check(name, FAIL, f"kernel raised {one_line(exc)}")
    want_shape = tuple(expected.shape)
    if tuple(out.shape) != want_shape:
        return Check(name, FAIL, f"output has shape {list(out.shape)}, expected {list(want_shape)}")
    symptoms = []
    if out.dtype != dt:
        symptoms.append(f"wrong output dtype: {str(out.dtype).removeprefix('torch.')}, expected {dtype} (q's dtype)")
    a = out.detach().to("cpu", torch.float64)
    nonfinite = int((~torch.isfinite(a)).sum())
    if nonfinite:
        return Check(name, FAIL, "; ".join([*symptoms, f"output differs: {nonfinite} non-finite values"]))
    num, den = (a - expected).norm(dim=-1), expected.norm(dim=-1)  # per (row, query, head)
    err = num.norm().item() / max(den.norm().item(), 1e-300)
    ratio = torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, torch.inf, 0.0))
    worst = float(ratio.max())
    bar, row_bar = tolerance("attention.forward", dtype), tolerance("attention.forward.row", dtype)
    detail = f"rel err {err:.1e} (bar {bar:.1e}); worst row {worst:.1e} (bar {row_bar:.1e})"
    if not (err <= bar and worst <= row_bar):
        b, i, h = (int(x) for x in (ratio == ratio.max()).nonzero()[0])
        unseen = bool(den[b, i, h] == 0)
        where = f"row {b} query {i} (cache slot {case.cache_len - case.q_len + i}) head {h}"
        symptoms.append(f"output differs: {detail} at {where}" +
                        (" (a query that sees no key must return zeros)" if unseen else ""))
    return Check(name, FAIL if symptoms else PASS, "; ".join(symptoms) if symptoms else detail)


def decode_checks(backend: Backend, dtype: str, cases: tuple[DecodeCase, ...] = DECODE_CASES) -> list[Check]:
    return [decode_check(backend, case, dtype) for case in cases]


def attention_checks(backend: Backend, dtype: str, cases: tuple[AttentionCase, ...] = ATTENTION_CASES
                     ) -> tuple[list[Check], list[CaseResult]]:
    checks, results = [], []
    for case in cases:
        result = run_attention_case(backend, case, dtype)
        results.append(result)
        checks.append(Check(f"varlen_attention {case.label()} {dtype}", PASS if result.ok else FAIL,
                            result.detail()))
    return checks, results


def device_graph_check(backend: Backend) -> Check:
    """``backend.device_graph()`` (docs/plugins.md): None passes (the hf engine's ``rollout.decode: graph`` is then
    refused on this backend). A capture function must run the step once to warm up, call ``before_capture``, record
    without running, and return a ``replay`` that runs the recorded work each time it is called."""
    import torch

    name = "device_graph"
    capture = backend.device_graph()
    if capture is None:
        return Check(name, PASS, "none (rollout.decode=graph is refused on this backend)")
    device = backend.device(0)
    x = torch.zeros((), device=device)
    y = torch.zeros((), device=device)
    seen: list[float] = []

    def step() -> None:
        x.add_(1)
        y.copy_(x * 2)

    def before_capture() -> None:
        seen.append(float(x))  # the warm-up ran: 1
        x.zero_()
        y.zero_()

    try:
        replay = capture(step, before_capture)
        after_capture = float(x)  # recording runs nothing: still 0
        replay()
        first = (float(x), float(y))
        replay()
        second = (float(x), float(y))
    except Exception as exc:
        return Check(name, FAIL, f"capture or replay raised {one_line(exc)}")
    problems = []
    if seen != [1.0]:
        problems.append(f"before_capture saw {seen} (expected one call after one warm-up run: [1.0])")
    if after_capture != 0.0:
        problems.append(f"the capture ran the step (x = {after_capture} after before_capture reset it to 0)")
    if (first, second) != ((1.0, 2.0), (2.0, 4.0)):
        problems.append(f"replays gave (x, y) = {first}, {second}; expected (1, 2), (2, 4)")
    return Check(name, FAIL if problems else PASS, "; ".join(problems) or "warm-up, before_capture, record, replay x2")


def run_conformance(backend: str | Backend, *, dtype: str = "float32", allow_unavailable: bool = False,
                    cases: tuple[AttentionCase, ...] = ATTENTION_CASES) -> ConformanceReport:
    """Run every check on ``backend`` (a registered name or an instance), its kernels in ``dtype``."""
    _torch_dtype(dtype)
    if isinstance(backend, str):
        backends = list_backends()
        if backend not in backends:
            raise KeyError(f"backend {backend!r} is not registered; registered: {sorted(backends)}")
        backend = backends[backend]
    checks = _declaration_checks(backend)
    avail = backend.availability()
    results: list[CaseResult] = []
    if avail.available:
        kernel_checks, results = attention_checks(backend, dtype, cases)
        checks += kernel_checks
        checks.append(logprobs_check(backend, dtype))
        checks.append(linear_logprobs_check(backend, dtype))
        checks.append(linear_logprob_loss_check(backend, dtype))
        checks += decode_checks(backend, dtype)
        checks.append(device_graph_check(backend))
    else:
        checks.append(Check("kernels vs oracle", NOT_RUN, f"backend not available: {avail.reason}"))
    return ConformanceReport(backend.name, checks, allow_unavailable, dtype, results)
