"""Start-up self-check for the first run on real Ascend hardware: do the assumptions about torch_npu hold?

Everything polyrl's ascend attention relies on (the window's ``pre_tockens = W - 1``, GQA through ``head_num``,
the compressed mask, the layout of ``softmax_max`` / ``softmax_sum``, the native ``sink=`` and its gradient, the
lse correction through ``npu_fusion_attention_grad``) was checked against Huawei's sources and the CPU emulator
only. This module runs one tiny ragged GQA call per case on the backend's device — sink route native and lse,
full causal, window 1 and window 128, float32 and bfloat16, forward and the gradients of q, k, v and the sinks —
against polyrl's CPU reference (fp32), with the bars of polyrl.core.tolerances. It takes seconds; a failure
names the case, so the first user with hardware learns at once which assumption broke.

    python -m polyrl.backends.ascend.selfcheck            # on an NPU machine

tests/ascend/test_selfcheck.py runs the same cases on the CPU emulator (which proves the check, not an NPU).

A route the installed release cannot take (native on a torch_npu without ``sink=``, or on Ascend 950) is reported
"not run" with the reason, never as passed. It is not wired into ``polyrl doctor`` yet.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from typing import Any

import torch

from polyrl.backends.ascend.attention import SINK_ENV, detect_sink_mode
from polyrl.core.tolerances import check_close

DOC_LENS = (1, 5, 130, 2)  # ragged: one-token documents and one longer than the 128-key window
HQ, HKV, D = 4, 2, 16  # GQA group of 2
ROUTES = ("native", "lse")
WINDOWS = (None, 1, 128)
DTYPES = (torch.float32, torch.bfloat16)
PASS, FAIL, NOT_RUN = "pass", "FAIL", "not run"


@dataclasses.dataclass(frozen=True)
class SelfCheckRow:
    route: str
    window: int | None
    dtype: str
    status: str
    detail: str = ""

    def line(self) -> str:
        w = "causal" if self.window is None else f"window {self.window}"
        return f"[{self.status:>7}] sinks {self.route:<6} {w:<11} {self.dtype:<8} {self.detail}"


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(DOC_LENS)
    cu = torch.tensor([0, *itertools.accumulate(DOC_LENS)], dtype=torch.int32)
    q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HQ, HKV, HKV))
    sinks = torch.randn(HQ, generator=gen)
    d_out = torch.randn(t, HQ, D, generator=gen)
    return (q, k, v), cu, sinks, d_out


def _attend(backend: Any, inputs, cu, sinks, d_out, window, dtype, device) -> list[torch.Tensor]:
    """Output and dq, dk, dv, dsink, on ``device`` in ``dtype`` (sinks stay fp32, as GPT-OSS's parameter may)."""
    leaves = [x.detach().to(device=device, dtype=dtype).clone().requires_grad_() for x in inputs]
    s = sinks.detach().to(device).clone().requires_grad_()
    out = backend.varlen_attention(*leaves, cu.to(device), scale=D**-0.5, window=window, sinks=s)
    out.backward(d_out.to(device=device, dtype=dtype))
    return [x.detach().float().cpu() for x in (out, *(leaf.grad for leaf in leaves), s.grad)]


def run_self_check(backend: Any = None) -> list[SelfCheckRow]:
    """Every case against the CPU reference; ``backend`` defaults to the registered ascend backend."""
    import torch_npu

    from polyrl.core.plugins import list_backends

    backend = backend if backend is not None else list_backends()["ascend"]
    ref_backend = list_backends()["cpu"]
    device = backend.device(0)
    inputs, cu, sinks, d_out = _inputs()
    detected, why = detect_sink_mode(torch_npu)
    rows = []
    saved = os.environ.get(SINK_ENV)
    try:
        for route, window, dtype in itertools.product(ROUTES, WINDOWS, DTYPES):
            name = str(dtype).removeprefix("torch.")
            if route == "native" and detected != "native":
                rows.append(SelfCheckRow(route, window, name, NOT_RUN, why))
                continue
            os.environ[SINK_ENV] = route
            expected = _attend(ref_backend, inputs, cu, sinks, d_out, window, torch.float32, torch.device("cpu"))
            try:
                got = _attend(backend, inputs, cu, sinks, d_out, window, dtype, device)
            except Exception as exc:  # the op refused the call: that is the finding
                rows.append(SelfCheckRow(route, window, name, FAIL, f"{type(exc).__name__}: {exc}"[:200]))
                continue
            worst, failed = "", []
            # With one key per query (window 1) dq and dk come only from the sink's share of each row: small beside
            # dv, so their error is measured against dv's magnitude, the scale of the terms involved.
            dv_norm = expected[3].double().norm().item() if window == 1 else 0.0
            for what, a, e in zip(("out", "dq", "dk", "dv", "dsink"), got, expected):
                floor = dv_norm if what in ("dq", "dk") else 0.0
                err, bar, ok = check_close("attention.forward" if what == "out" else "attention.grad", a, e, dtype,
                                           floor=floor)
                worst += f"{what} {err:.1e}/{bar:.0e} "
                if not ok:
                    failed.append(what)
            status = FAIL if failed else PASS
            rows.append(SelfCheckRow(route, window, name, status,
                                     (f"wrong: {', '.join(failed)}; " if failed else "") + worst.strip()))
    finally:
        if saved is None:
            os.environ.pop(SINK_ENV, None)
        else:
            os.environ[SINK_ENV] = saved
    return rows


def main() -> int:
    rows = run_self_check()
    for row in rows:
        print(row.line(), flush=True)
    ran = [r for r in rows if r.status != NOT_RUN]
    return 0 if ran and all(r.status == PASS for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
