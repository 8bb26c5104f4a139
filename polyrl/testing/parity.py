"""Cross-backend parity: compare a backend with the CPU reference (fp32) on the same inputs and seeds.

Levels (DESIGN.md "Parity"): ``op`` — varlen_attention forward and gradients over a grid; ``model`` —
per-token logprobs of the tiny GPT-OSS and DeepSeek-V3 presets, packed; ``step``/``recipe`` need the
trainer and are reported ``not run`` with the reason until they are wired here.

Every row carries the measured error next to the bar from :mod:`polyrl.core.tolerances`; a backend that
cannot run on this machine is ``not run``, never ``pass``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from polyrl.core.backend import Backend

LEVELS = ("op", "model", "step", "recipe")
PASS, FAIL, NOT_RUN = "pass", "fail", "not run"


@dataclasses.dataclass
class ParityRow:
    level: str
    case: str
    status: str
    error: float | None = None
    bar: float | None = None
    detail: str = ""

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _compute_dtype(backend: Backend) -> str:
    # Accelerators are compared in the dtype they train in; the cpu reference with itself in fp32.
    return "float32" if backend.is_reference else "bfloat16"


ATTENTION_RESULT_LABELS = ("out", "dq", "dk", "dv", "dsinks")


def compare_attention_results(dut: list, ref: list, dtype: str, window: int | None, has_sinks: bool
                              ) -> list[tuple[str, float | None, float | None, bool]]:
    """(label, relative error, bar, ok) for [out, dq, dk, dv(, dsinks)] of a backend vs the reference.

    A missing gradient is reported with error None. Window 1 without sinks: softmax over one key is
    constant, so dq and dk are exactly zero and any kernel leaves rounding noise; that noise is measured
    against the gradient scale (||dv||) instead of the zero answer.
    """
    from polyrl.core.tolerances import check_close

    results = []
    for i, label in enumerate(ATTENTION_RESULT_LABELS[: len(ref)]):
        got = dut[i]
        if got is None:
            results.append((label, None, None, False))
            continue
        floor = ref[3].norm().item() if window == 1 and not has_sinks and label in ("dq", "dk") else 0.0
        err, bar, ok = check_close("attention.forward" if i == 0 else "attention.grad",
                                   got.float().cpu(), ref[i].float().cpu(), dtype, floor=floor)
        results.append((label, err, bar, ok))
    return results


def run_attention_case(backend: Backend, q, k, v, cu_seqlens, sinks, dout, window: int | None, dtype: str
                       ) -> tuple[list, list]:
    """Forward + backward of one case on ``backend`` (in ``dtype``) and on the cpu reference (fp32).

    Returns ([out, dq, dk, dv(, dsinks)] of the backend, the same of the reference). Each run gets its own
    leaves: ``.to()`` returns the very tensor when nothing changes, and shared leaves would make the two
    runs accumulate into one ``.grad``.
    """
    import torch

    from polyrl.core.attention import varlen_attention

    results = []
    for target, device, dt in ((backend, backend.device(0), getattr(torch, dtype)),
                               ("cpu", torch.device("cpu"), torch.float32)):
        leaves = [x.detach().to(device, dt).clone().requires_grad_() for x in (q, k, v)]
        s = None if sinks is None else sinks.detach().to(device).clone().requires_grad_()
        out = varlen_attention(*leaves, cu_seqlens.to(device), window=window, sinks=s, backend=target)
        out.backward(dout.to(device, dt))
        results.append([out] + [x.grad for x in leaves] + ([s.grad] if s is not None else []))
    return results[0], results[1]


def op_parity(backend: Backend, dtype: str) -> list[ParityRow]:
    import torch

    rows = []
    gen = torch.Generator().manual_seed(0)
    doc_lens = (1, 37, 150, 5)
    cu = torch.tensor([0, *itertools.accumulate(doc_lens)], dtype=torch.int32)
    t = sum(doc_lens)
    for window, sink_scale, ratio in itertools.product((None, 1, 3, 128), (None, 1.0, 30.0), (1, 8)):
        hkv, d = 2, 64
        q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hkv * ratio, hkv, hkv))
        sinks = None if sink_scale is None else sink_scale * torch.randn(hkv * ratio, generator=gen)
        dout = torch.randn(t, hkv * ratio, d, generator=gen)
        dut, ref = run_attention_case(backend, q, k, v, cu, sinks, dout, window, dtype)
        case = f"varlen_attention {{}} window={window} sinks={sink_scale} gqa={ratio}"
        for label, err, bar, ok in compare_attention_results(dut, ref, dtype, window, sinks is not None):
            status = FAIL if err is None else (PASS if ok else FAIL)
            rows.append(ParityRow("op", case.format(label), status, err, bar, "" if err is not None else "no gradient"))
    return rows


def model_parity(backend: Backend, dtype: str) -> list[ParityRow]:
    import torch

    from polyrl.core import algorithms as A
    from polyrl.core.models import build_model
    from polyrl.core.selection import get_active_backend, set_active_backend
    from polyrl.core.tolerances import TOLERANCES, check_close

    rows = []
    doc_lens = (9, 1, 40)
    positions = torch.cat([torch.arange(n) for n in doc_lens])[None]
    previous = get_active_backend().name
    try:
        for preset in ("gpt_oss_tiny", "deepseek_v3_tiny"):
            model = build_model(preset, vocab_size=32, seed=0, dtype=torch.float32,
                                overrides={"sliding_window": 4} if preset.startswith("gpt_oss") else None)
            ids = torch.randint(0, 32, (1, sum(doc_lens)), generator=torch.Generator().manual_seed(1))
            labels = ids[:, 1:]
            set_active_backend("cpu")
            with torch.no_grad():
                ref = A.logprobs_from_logits(model(input_ids=ids, position_ids=positions).logits[:, :-1], labels)
            set_active_backend(backend.name)
            dev = backend.device(0)
            dut_model = model.to(dev, getattr(torch, dtype))
            with torch.no_grad():
                logits = dut_model(input_ids=ids.to(dev), position_ids=positions.to(dev)).logits[:, :-1]
                got = A.logprobs_from_logits(logits, labels.to(dev)).float().cpu()
            key = ("model.logprobs", dtype)
            if key not in TOLERANCES:
                rows.append(ParityRow("model", f"{preset} packed logprobs", NOT_RUN,
                                      detail=f"no tolerance for {key} in polyrl/core/tolerances.py"))
                continue
            err, bar, ok = check_close("model.logprobs", got, ref, dtype)
            rows.append(ParityRow("model", f"{preset} packed logprobs", PASS if ok else FAIL, err, bar))
    finally:
        set_active_backend(previous)
    return rows


def run_parity(backend: Backend, levels: tuple[str, ...] = LEVELS) -> list[ParityRow]:
    avail = backend.detect()
    if not avail.available:
        return [ParityRow(level, "all", NOT_RUN, detail=f"backend {backend.name} not available: {avail.reason}")
                for level in levels]
    dtype = _compute_dtype(backend)
    runners: dict[str, Callable[[Backend, str], list[ParityRow]]] = {"op": op_parity, "model": model_parity}
    rows: list[ParityRow] = []
    for level in levels:
        if level in runners:
            rows += runners[level](backend, dtype)
        else:
            rows.append(ParityRow(level, "all", NOT_RUN, detail=f"level {level!r} is not implemented yet"))
    return rows
