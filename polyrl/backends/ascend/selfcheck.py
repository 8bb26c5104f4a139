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

It also runs the MoE experts kernel (polyrl.backends.ascend.experts: ``npu_grouped_matmul`` forward, its backward
through ``npu_grouped_matmul_add_``) on one experts layer of each tiny preset, float32 and bfloat16, against the
reference experts, and the backend's all-to-all (expert parallelism's exchange) on a one-process group of the
device's collective library: bf16, float32 and int64 rows, and a rank that sends and receives no rows at all.

A route the installed release cannot take (native on a torch_npu without ``sink=``, or on Ascend 950; lse without
``softmax_layout="TND"``) is reported
"not run" with the reason, never as passed. ``polyrl doctor --backend ascend --selfcheck`` runs this module (a
child process) after the compatibility report; docs/ascend.md has the first-run checklist around it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from typing import Any

import torch

from polyrl.backends.ascend.attention import SINK_ENV, detect_sink_mode, lse_route_problem
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
        if self.route not in ROUTES:  # "experts gpt_oss_tiny", "all_to_all ...": not an attention case
            return f"[{self.status:>7}] {self.route:<30} {self.dtype:<8} {self.detail}"
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
            if route == "lse" and (problem := lse_route_problem(torch_npu)):
                rows.append(SelfCheckRow(route, window, name, NOT_RUN, problem))
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
                kind = {"out": "attention.forward", "dsink": "attention.dsinks"}.get(what, "attention.grad")
                err, bar, ok = check_close(kind, a, e, dtype, floor=floor)
                worst += f"{what} {err:.1e}/{bar:.1e} "
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


EXPERTS_PRESETS = ("gpt_oss_tiny", "deepseek_v3_tiny")  # GPT-OSS: [E, in, out] weights, biases; DeepSeek: [E, out, in]


def _experts_run(module, fn, case, dtype, device) -> list[torch.Tensor]:
    """Output, d hidden and every weight's gradient of ``fn(module, ...)`` in ``dtype`` on ``device`` (fp32, CPU)."""
    hidden, top_k_index, top_k_weights, d_out = case
    h = hidden.to(device, dtype).clone().requires_grad_()
    out = fn(module, h, top_k_index.to(device), top_k_weights.to(device, dtype))
    out.backward(d_out.to(device, dtype))
    return [out.detach().float().cpu(), h.grad.float().cpu(), *(p.grad.float().cpu() for p in module.parameters())]


def run_experts_check(backend: Any = None) -> list[SelfCheckRow]:
    """The MoE experts kernel (npu_grouped_matmul forward, and its written backward: a transposed-weight call and a
    group_type=2 call) on the first experts module of each tiny preset, against the reference experts (fp32, CPU):
    output and the gradients of every expert weight and of the input."""
    import copy

    from polyrl.core.models import build_model
    from polyrl.core.models.experts import reference_experts
    from polyrl.core.plugins import list_backends

    backend = backend if backend is not None else list_backends()["ascend"]
    device = backend.device(0)
    rows = []
    for preset in EXPERTS_PRESETS:
        model = build_model(preset, vocab_size=32, seed=0, backend=list_backends()["cpu"])
        experts = next(m for m in model.modules() if hasattr(m, "down_proj") and hasattr(m, "num_experts"))
        gen = torch.Generator().manual_seed(1)
        t, k = 24, model.config.num_experts_per_tok
        hidden = torch.randn(t, model.config.hidden_size, generator=gen)
        top_k_index = torch.rand(t, experts.num_experts, generator=gen).topk(k, dim=-1).indices
        top_k_weights = torch.rand(t, k, generator=gen).softmax(-1)
        d_out = torch.randn(t, model.config.hidden_size, generator=gen)

        case = (hidden, top_k_index, top_k_weights, d_out)
        expected = _experts_run(copy.deepcopy(experts), reference_experts, case, torch.float32, torch.device("cpu"))
        for dtype in DTYPES:
            name = str(dtype).removeprefix("torch.")
            try:
                got = _experts_run(copy.deepcopy(experts).to(device, dtype), backend.experts, case, dtype, device)
            except Exception as exc:  # the op refused the call: that is the finding
                rows.append(SelfCheckRow(f"experts {preset}", None, name, FAIL, f"{type(exc).__name__}: {exc}"[:200]))
                continue
            errs = [check_close("experts.forward" if i == 0 else "experts.grad", a, e, dtype)
                    for i, (a, e) in enumerate(zip(got, expected))]
            worst = max(err for err, _, _ in errs)
            ok = all(o for _, _, o in errs)
            rows.append(SelfCheckRow(f"experts {preset}", None, name, PASS if ok else FAIL,
                                     f"worst {worst:.1e} (out, dx, {len(got) - 2} weight grads)"))
    return rows


ALL_TO_ALL_DTYPES = (torch.bfloat16, torch.float32, torch.int64)


def run_all_to_all_check(backend: Any = None) -> list[SelfCheckRow]:
    """``backend.all_to_all`` on a one-process group of its collective library (HCCL on the NPU): five rows to
    itself, and no rows at all (a 0-row tensor, as a rank that receives no tokens sends in decode), per dtype; the
    rows must arrive bit for bit. The group is the process's own when one is open."""
    import torch.distributed as dist

    from polyrl.core.plugins import list_backends

    backend = backend if backend is not None else list_backends()["ascend"]
    device = backend.device(0)
    own = not dist.is_initialized()
    if own:
        dist.init_process_group(backend.collective_backend, store=dist.HashStore(), rank=0, world_size=1,
                                **backend.process_group_options(0))
    rows = []
    try:
        for dtype, n in itertools.product(ALL_TO_ALL_DTYPES, (5, 0)):
            name = str(dtype).removeprefix("torch.")
            case = f"all_to_all {'empty rank' if n == 0 else f'{n} rows'}"
            sent = (torch.arange(n * 6, dtype=torch.float32).view(n, 6) * 0.37 - 3).to(device=device, dtype=dtype)
            got = torch.full_like(sent, 7)
            try:
                backend.all_to_all(got, sent, [n], [n])
            except Exception as exc:  # the library refused the call: that is the finding
                rows.append(SelfCheckRow(case, None, name, FAIL, f"{type(exc).__name__}: {exc}"[:200]))
                continue
            exact = got.shape == sent.shape and torch.equal(got.cpu(), sent.cpu())
            rows.append(SelfCheckRow(case, None, name, PASS if exact else FAIL,
                                     "bit for bit" if exact else "rows differ from those sent"))
    finally:
        if own:
            dist.destroy_process_group()
    return rows


def main() -> int:
    rows = run_self_check() + run_experts_check() + run_all_to_all_check()
    for row in rows:
        print(row.line(), flush=True)
    ran = [r for r in rows if r.status != NOT_RUN]
    return 0 if ran and all(r.status == PASS for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
