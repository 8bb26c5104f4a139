"""Cross-backend parity: a backend, in the dtype it trains in, against references on the same inputs.

Levels (docs/parity.md): ``op`` — varlen_attention forward and gradients on the conformance kit's cases
(:data:`polyrl.testing.conformance.ATTENTION_CASES`, one list for both) against the fp64 oracle, judged
exactly as the kit judges them; ``model`` — per-token logprobs of the tiny GPT-OSS and DeepSeek-V3 presets,
packed, against the cpu backend's fp32 model; ``step`` — one RL update of each tiny recipe on fixed rollouts
against the same update on the cpu backend; ``recipe`` — N steps of each tiny recipe through ``polyrl run``,
several seeds, seed-averaged reward and loss curves against the cpu backend's (both:
:mod:`polyrl.parity.train`).

The dtype is the backend's own policy (``sharding_policy().param_dtype``: float32 for cpu, bfloat16 for the
accelerators), unless the caller names one; every row states it. Every row carries the measured error next
to the bar from :mod:`polyrl.core.tolerances`; a backend that cannot run on this machine is ``not run``,
never ``pass``.
"""

from __future__ import annotations

from collections.abc import Callable

from polyrl.core.plugins import Backend
from polyrl.parity.rows import FAIL, LEVELS, NOT_RUN, PASS, REFERENCES, OnRow, ParityRow

__all__ = ["FAIL", "LEVELS", "NOT_RUN", "PASS", "REFERENCES", "OnRow", "ParityRow", "backend_dtype", "level_summary",
           "model_parity", "op_parity", "parity_report", "run_parity"]


def backend_dtype(backend: Backend) -> str:
    """The dtype ``backend`` computes in when it trains: its sharding policy's ``param_dtype``."""
    return backend.sharding_policy().param_dtype


def _emitter(rows: list[ParityRow], on_row: OnRow | None) -> Callable[[ParityRow], None]:
    def emit(row: ParityRow) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    return emit


def op_parity(backend: Backend, dtype: str, on_row: OnRow | None = None) -> list[ParityRow]:
    """One row per (kit case, result tensor): relative norm error beside its bar; the worst row in detail.
    ``on_row`` is called with each row as soon as its case has run (progress)."""
    from polyrl.testing.conformance import ATTENTION_CASES, run_attention_case

    rows: list[ParityRow] = []
    emit = _emitter(rows, on_row)
    for case in ATTENTION_CASES:
        result = run_attention_case(backend, case, dtype)
        if result.raised:
            emit(ParityRow("op", f"varlen_attention {case.name}", FAIL, detail=result.symptoms()[0], dtype=dtype))
            continue
        for t in result.tensors:
            if t.ok:
                detail = "" if t.row_error is None else f"worst row {t.row_error:.1e} (bar {t.row_bar:.1e})"
            else:
                detail = "; ".join(t.symptoms())
            emit(ParityRow("op", f"varlen_attention {case.name}: {t.name}", PASS if t.ok else FAIL,
                           t.error, t.bar, detail, dtype))
    return rows


def model_parity(backend: Backend, dtype: str, on_row: OnRow | None = None) -> list[ParityRow]:
    import torch

    from polyrl.core import algorithms as A
    from polyrl.core.attention.hf import bind_backend
    from polyrl.core.models import build_model
    from polyrl.core.plugins import list_backends
    from polyrl.core.tolerances import TOLERANCES, check_close

    rows: list[ParityRow] = []
    emit = _emitter(rows, on_row)
    doc_lens = (9, 1, 40)
    positions = torch.cat([torch.arange(n) for n in doc_lens])[None]
    cpu = list_backends()["cpu"]
    for preset in ("gpt_oss_tiny", "deepseek_v3_tiny"):
        model = build_model(preset, vocab_size=32, seed=0, dtype=torch.float32, backend=cpu,
                            overrides={"sliding_window": 4} if preset.startswith("gpt_oss") else None)
        ids = torch.randint(0, 32, (1, sum(doc_lens)), generator=torch.Generator().manual_seed(1))
        labels = ids[:, 1:]
        with torch.no_grad():
            ref = A.logprobs_from_logits(model(input_ids=ids, position_ids=positions).logits[:, :-1], labels)
        dev = backend.device(0)
        dut_model = model.to(dev, getattr(torch, dtype))
        bind_backend(dut_model, backend)  # the same weights, now on the backend under test
        with torch.no_grad():
            logits = dut_model(input_ids=ids.to(dev), position_ids=positions.to(dev)).logits[:, :-1]
            got = A.logprobs_from_logits(logits, labels.to(dev)).float().cpu()
        key = ("model.logprobs", dtype)
        if key not in TOLERANCES:
            emit(ParityRow("model", f"{preset} packed logprobs", NOT_RUN,
                           detail=f"no tolerance for {key} in polyrl/core/tolerances.py", dtype=dtype))
            continue
        err, bar, ok = check_close("model.logprobs", got, ref, dtype)
        emit(ParityRow("model", f"{preset} packed logprobs", PASS if ok else FAIL, err, bar,
                       "" if ok else "logprobs differ from the cpu backend's fp32 model", dtype))
    return rows


def run_parity(backend: Backend, levels: tuple[str, ...] = LEVELS, dtype: str | None = None,
               on_row: OnRow | None = None, *, steps: int | None = None, seeds: tuple[int, ...] | None = None,
               emulate: bool = False, jobs: int = 2, recipes: tuple[str, ...] | None = None,
               overrides: tuple[str, ...] = ()) -> list[ParityRow]:
    """Rows of every level in ``levels``, in ``dtype`` (default: the backend's own, :func:`backend_dtype`, for
    ``op``/``model``; the recipe's own ``model.dtype`` for ``step``/``recipe``, which run the trainer as a
    single-process ``polyrl run`` does); ``on_row`` sees each row as it completes. ``steps``/``seeds``: the
    recipe level's run length and seeds; ``emulate``: the backend runs through its emulator (``--emulate``),
    passed on to the recipe level's ``polyrl run``; ``jobs``: recipe-level runs at a time; ``recipes``: the
    step and recipe levels' recipes (default: both tiny recipes); ``overrides``: ``key.path=value`` changes to those
    recipes, on both sides of the comparison (e.g. ``model.lora.enabled=true``; the op and model levels have none)."""
    from polyrl.parity import train as T

    explicit = dtype
    dtype = dtype or backend_dtype(backend)
    rows: list[ParityRow] = []
    emit = _emitter(rows, on_row)
    avail = backend.availability()
    if not avail.available:
        for level in levels:
            emit(ParityRow(level, "all", NOT_RUN, detail=f"backend {backend.name} not available: {avail.reason}",
                           dtype=dtype))
        return rows
    for level in levels:
        if level == "op":
            rows += op_parity(backend, dtype, on_row)
        elif level == "model":
            rows += model_parity(backend, dtype, on_row)
        elif level == "step":
            T.step_parity(backend, explicit, emit, recipes or T.TINY_RECIPES, overrides)
        elif level == "recipe":
            T.recipe_parity(backend, emit, steps=steps or T.DEFAULT_STEPS, seeds=seeds or T.DEFAULT_SEEDS,
                            emulate=emulate, jobs=jobs, dtype=explicit, recipes=recipes or T.TINY_RECIPES,
                            overrides=overrides)
    return rows


def level_summary(rows: list[ParityRow], level: str) -> str:
    """``pass`` when every row of ``level`` ran and passed, ``fail`` when any failed, else ``not run``."""
    mine = [r for r in rows if r.level == level]
    if any(r.status == FAIL for r in mine):
        return FAIL
    if mine and all(r.status == PASS for r in mine):
        return PASS
    return NOT_RUN


def parity_report(backend: Backend, dtype: str, rows: list[ParityRow], levels: tuple[str, ...],
                  emulated: bool = False) -> dict[str, object]:
    """The ``--json`` object: what ran, then one key per level with its reference, summary status and rows."""
    report: dict[str, object] = {"backend": backend.name, "origin": backend.origin(), "dtype": dtype,
                                 "emulated": emulated}
    for level in levels:
        report[level] = {"reference": REFERENCES[level].format(dtype=dtype), "status": level_summary(rows, level),
                         "rows": [r.as_dict() for r in rows if r.level == level]}
    return report
