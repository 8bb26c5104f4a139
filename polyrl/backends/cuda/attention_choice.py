"""Which attention kernel the cuda backend runs, per call: FlashAttention-4 or polyrl's Triton kernel.

The rule reads ``MEASURED``, the table of same-run measurements below, and picks per layout:

- full-causal layers: FA4 where it measured faster (forward + backward, the training step) for that layout, dtype
  and head dims; sliding-window layers: the Triton kernel (it measured as fast or faster there);
- always the Triton kernel for fp32 inputs, for head dims FA4 cannot take on the GPU or that were not measured
  (DeepSeek MLA's 192 / 128), where ``flash_attn.cute`` does not import, and on GPUs other than compute
  capability 9.x / 10.x (read from the tensor's device, once per device).

``POLYRL_CUDA_ATTENTION`` overrides the rule: ``auto`` (the default, the rule), ``triton``, ``fa4``, or per layout
``causal=<impl>,window=<impl>`` (each ``auto`` / ``triton`` / ``fa4``; a layout left out is ``auto``). A value
outside these is refused (``BadInputError``); forcing ``fa4`` where FA4 cannot run a call is refused too, with the
reason, never replaced by the Triton kernel behind the user's back.

Nothing here touches the GPU or imports FA4 at import time: the FA4 import is tried on the first call that would
run it (and remembered), the compute capability is read on the first call per device, and the report that
``polyrl backends`` prints (``layout_report``) only looks for the package on disk.

FlashAttention-4 as confirmed from flash-attn-4 4.0.0b36's ``flash_attn/cute/interface.py`` (the wheel's source):

- ``flash_attn_varlen_func``'s fourth positional parameter is ``qv`` (the absorbed-MLA query part), so every other
  argument is passed by keyword. The ones used here: ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32, contiguous,
  [N+1]), ``max_seqlen_q`` / ``max_seqlen_k`` (Python ints), ``softmax_scale``, ``causal``, ``window_size`` (a
  (left, right) pair: query i sees keys i - left .. i + right; ``causal=True`` sets right to 0, and a left of
  None with causal is plain causal), ``learnable_sink`` ([Hq], fp16 / bf16 / fp32, a natural-log logit that is
  NOT multiplied by the softmax scale, entering the denominator only), ``deterministic`` (default False: the
  backward's dQ accumulation order is then not fixed). There is also ``softcap``, ``num_splits``, ``pack_gqa``.
- It returns a pair (out, lse) whatever ``return_lse`` says; out is [T, Hq, Dv] in q's dtype, lse fp32 [Hq, T].
- Inputs: fp16 / bf16 (fp8 forward-only on 10.x); fp32 is refused. Hq a multiple of Hkv.
- GPUs: the forward runs on 8.x-12.x, the backward on 9.x-12.x; the sink's gradient on 9.x and 10.x / 11.x only;
  a deterministic backward everywhere but 12.x.
- Head dims (D for q / k, Dv for v, each a multiple of 8 for 16-bit inputs): on 9.x both within 8..256 (D != Dv
  allowed, 192 / 128 included); on 10.x / 11.x both within 8..128, or exactly 192 / 128, or 256 / 256 (whose
  backward takes no sink), or Dv 512 (absorbed MLA, not polyrl's layout).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from polyrl.core.errors import BadInputError

if TYPE_CHECKING:
    import torch

ENV = "POLYRL_CUDA_ATTENTION"
IMPLS = ("auto", "triton", "fa4")
LAYOUTS = ("causal", "window")
# The GPUs the FA4 path runs on (compute capability major): Hopper and Blackwell datacenter parts, where the
# backward with sinks and its deterministic mode exist (module docstring) and where it was measured (9.0).
FA4_MAJORS = (9, 10)
INSTALL_HINT = "pip install 'polyrl[fa4]'"


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One case measured with both kernels in the same process: (fwd ms, fwd+bwd ms) each."""

    layout: str  # documents x tokens, packed
    window: int | None  # None: full causal
    head_dims: tuple[int, int]  # (D, Dv)
    triton_ms: tuple[float, float]
    fa4_ms: tuple[float, float]


# Where the figures come from: bench/attention.py on one GPU, 64 q / 8 kv heads, sinks on, both kernels in one
# process (bench/results/attention.json holds an earlier run without FA4, so the pair is recorded here).
MEASURED_ON: dict[str, Any] = {
    "date": "2026-12-01", "gpu": "NVIDIA H200", "compute_capability": "9.0", "commit": "8501bd4",
    "dtype": "bfloat16", "heads": "64 q / 8 kv", "sinks": True,
    "flash-attn-4": "4.0.0b36", "nvidia-cutlass-dsl": "4.8.1",
}
MEASURED: tuple[Measurement, ...] = (
    Measurement("4x4096", None, (64, 64), triton_ms=(1.485, 7.542), fa4_ms=(1.132, 4.273)),
    Measurement("1x16384", None, (64, 64), triton_ms=(5.486, 27.03), fa4_ms=(4.187, 14.74)),
    Measurement("4x4096", 128, (64, 64), triton_ms=(0.321, 1.215), fa4_ms=(0.337, 1.246)),
)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The kernel that runs ("fa4" or "triton") and why, in words."""

    kernel: str
    reason: str

    def __str__(self) -> str:
        return f"{self.kernel} ({self.reason})"


# --- the setting ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def parse_setting(value: str) -> dict[str, str]:
    """``POLYRL_CUDA_ATTENTION``'s value -> {"causal": impl, "window": impl}; ``BadInputError`` when malformed."""
    text = value.strip().lower()
    if text in IMPLS or text == "":
        return dict.fromkeys(LAYOUTS, text or "auto")
    setting = dict.fromkeys(LAYOUTS, "auto")
    seen = set()
    for part in text.split(","):
        layout, sep, impl = (s.strip() for s in part.partition("="))
        if not sep or layout not in LAYOUTS or impl not in IMPLS or layout in seen:
            raise BadInputError(f"{ENV}={value!r}: expected one of {', '.join(IMPLS)}, or "
                                f"causal=<impl>,window=<impl> with <impl> one of {', '.join(IMPLS)}")
        seen.add(layout)
        setting[layout] = impl
    return setting


def current_setting() -> str:
    return os.environ.get(ENV, "auto")


# --- what FA4 can take ----------------------------------------------------------------------------------------
def fa4_dtype_problem(dtype: torch.dtype) -> str:
    import torch

    if dtype in (torch.bfloat16, torch.float16):
        return ""
    return f"FA4 takes bfloat16 / float16 inputs, not {str(dtype).removeprefix('torch.')}"


def fa4_head_dims_problem(d: int, dv: int, major: int, *, has_sinks: bool) -> str:
    """Why FA4 (4.0.0b36) cannot take head dims (D, Dv) with 16-bit inputs on a GPU of compute capability
    ``major``.x with its backward (sinks included), "" when it can (module docstring)."""
    dims = f"head dims {d} / {dv}"
    if d % 8 or dv % 8:
        return f"FA4 needs head dims that are multiples of 8, got {d} / {dv}"
    if major == 9:
        return "" if 8 <= d <= 256 and 8 <= dv <= 256 else f"FA4 on compute capability 9.x takes 8..256, not {dims}"
    if major in (10, 11):
        if (8 <= d <= 128 and 8 <= dv <= 128) or (d, dv) == (192, 128):
            return ""
        if (d, dv) == (256, 256):
            return "FA4's 256 / 256 backward takes no sink on compute capability 10.x" if has_sinks else ""
        return f"FA4 on compute capability {major}.x takes 8..128, 192 / 128 or 256 / 256, not {dims}"
    return f"the FA4 path runs on compute capability 9.x / 10.x, not {major}.x"


def _measured_verdict(layout: str, dtype: torch.dtype, d: int, dv: int) -> Choice:
    """The kernel the measurements favour for one layout, dtype and head dims, and the figure that says so.
    Unmeasured combinations keep the Triton kernel: the rule only moves what was measured."""
    measured_dtype = MEASURED_ON["dtype"]
    rows = [m for m in MEASURED if (m.window is None) == (layout == "causal") and m.head_dims == (d, dv)]
    if str(dtype).removeprefix("torch.") != measured_dtype:
        return Choice("triton", f"FA4 not measured in {str(dtype).removeprefix('torch.')} (only {measured_dtype})")
    if not rows:
        return Choice("triton", f"FA4 not measured at head dims {d} / {dv} ({layout} layers)")
    first = rows[0]
    case = first.layout + (f" window {first.window}" if first.window is not None else "")
    where = f"on {MEASURED_ON['gpu']}, {case}"
    # fwd+bwd decides: a training step runs both. FA4 only where it wins every measured case of the layout.
    if all(m.fa4_ms[1] < m.triton_ms[1] for m in rows):
        return Choice("fa4", f"measured {first.triton_ms[1] / first.fa4_ms[1]:.2f}x faster fwd+bwd than triton {where}")
    return Choice("triton", f"measured {first.fa4_ms[1] / first.triton_ms[1]:.2f}x faster fwd+bwd than fa4 {where}")


# --- what this machine has (each read once) -------------------------------------------------------------------
@functools.cache
def _fa4_import() -> tuple[Callable[..., Any] | None, str]:
    """(flash_attn.cute.flash_attn_varlen_func, "") or (None, why not). Tried once: importing the CuTe DSL takes
    seconds, and its answer does not change within a process."""
    try:
        module = importlib.import_module("flash_attn.cute")
    except ModuleNotFoundError as exc:
        if exc.name in ("flash_attn", "flash_attn.cute"):
            return None, f"flash_attn.cute not installed; {INSTALL_HINT}"
        return None, f"flash_attn.cute does not import (ModuleNotFoundError: {exc})"
    except Exception as exc:  # e.g. the CuTe DSL finding no usable CUDA toolkit
        first = (str(exc).strip().splitlines() or [""])[0]
        return None, f"flash_attn.cute does not import ({type(exc).__name__}: {first})"
    fn = getattr(module, "flash_attn_varlen_func", None)
    if not callable(fn):
        return None, "flash_attn.cute has no flash_attn_varlen_func"
    return fn, ""


def fa4_function() -> Callable[..., Any]:
    """flash_attn.cute.flash_attn_varlen_func (imported on first use); ``BadInputError`` when it does not import."""
    fn, problem = _fa4_import()
    if fn is None:
        raise BadInputError(f"FlashAttention-4 is not usable: {problem}")
    return fn


def fa4_installed_problem() -> str:
    """Why ``flash_attn.cute`` is not on disk, "" when it is; found without importing it (``polyrl backends``
    imports no vendor module). Whether it actually imports is known only on the first call that runs it."""
    if "flash_attn.cute" in sys.modules:
        return ""
    try:
        spec = importlib.util.find_spec("flash_attn")  # top level: finds the package without importing it
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if any(os.path.isfile(os.path.join(loc, "cute", "__init__.py")) for loc in locations):
        return ""
    return f"flash_attn.cute not installed; {INSTALL_HINT}"


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    import torch

    return tuple(torch.cuda.get_device_capability(index))


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA tensor's device, read once per device; None for another device type."""
    if device.type != "cuda":
        return None
    if device.index is None:
        import torch

        return _capability(torch.cuda.current_device())
    return _capability(device.index)


# --- the rule ----------------------------------------------------------------------------------------------
def decide(setting: str, layout: str, dtype: torch.dtype, d: int, dv: int, *, has_sinks: bool,
           capability: tuple[int, int] | None, fa4_problem: Callable[[], str]) -> Choice:
    """The kernel for one call's layout ("causal" / "window"), dtype, head dims and GPU (``capability``: None where
    the tensors are not on a CUDA device). ``fa4_problem`` says why FA4 cannot be used ("" when it can); it is
    asked last, only when FA4 would run. ``BadInputError`` for a bad setting or an ``fa4`` forced that cannot run."""
    impl = parse_setting(setting)[layout]
    if impl == "triton":
        return Choice("triton", f"{ENV}={setting}")
    problem = fa4_dtype_problem(dtype)
    if not problem:
        if capability is None:
            problem = "the tensors are not on a CUDA device"
        elif capability[0] not in FA4_MAJORS:
            problem = f"the FA4 path runs on compute capability 9.x / 10.x, not {capability[0]}.{capability[1]}"
        else:
            problem = fa4_head_dims_problem(d, dv, capability[0], has_sinks=has_sinks)
    verdict = None
    if impl == "auto" and not problem:
        verdict = _measured_verdict(layout, dtype, d, dv)
        if verdict.kernel == "triton":
            return verdict
    problem = problem or fa4_problem()
    if impl == "fa4":
        if problem:
            raise BadInputError(f"{ENV}={setting} forces FlashAttention-4 for {layout} layers, but it cannot run "
                                f"this call: {problem}")
        return Choice("fa4", f"{ENV}={setting}")
    if problem or verdict is None:
        return Choice("triton", problem)
    return verdict


_CHOICES: dict[tuple, Choice] = {}


def choose(q: torch.Tensor, v: torch.Tensor, window: int | None, sinks: torch.Tensor | None) -> Choice:
    """The kernel for this call (``decide`` on its tensors), remembered per (setting, layout, dtype, head dims,
    sinks, device): every layer of a step asks, and the answer only changes with the setting."""
    setting = current_setting()
    layout = "causal" if window is None else "window"
    key = (setting, layout, q.dtype, q.shape[-1], v.shape[-1], sinks is not None, q.device)
    choice = _CHOICES.get(key)
    if choice is None:
        choice = _CHOICES[key] = decide(
            setting, layout, q.dtype, q.shape[-1], v.shape[-1], has_sinks=sinks is not None,
            capability=device_capability(q.device), fa4_problem=lambda: _fa4_import()[1])
    return choice


def clear_caches() -> None:
    """Forget the remembered choices, FA4 import and capabilities (tests; a process that installs FA4 late)."""
    _CHOICES.clear()
    _fa4_import.cache_clear()
    _capability.cache_clear()
    parse_setting.cache_clear()


# --- the report -----------------------------------------------------------------------------------------------
def layout_report() -> dict[str, str]:
    """{layout: "kernel (why)"} for the measured shapes (bf16, the table's head dims), as ``polyrl backends``
    prints it, plus "other" for the inputs that always take the Triton kernel. Reads no device and imports no
    vendor module: the GPU condition is stated, not checked, and FA4 is looked for on disk."""
    import torch

    setting = current_setting()
    d, dv = MEASURED[0].head_dims
    report = {}
    for layout in LAYOUTS:
        try:
            # capability (9, 0): the condition is stated in words below instead of read (that would start CUDA).
            choice = decide(setting, layout, torch.bfloat16, d, dv, has_sinks=True, capability=(9, 0),
                            fa4_problem=fa4_installed_problem)
        except BadInputError as exc:
            report[layout] = f"error ({exc})"
            continue
        text = str(choice)
        if choice.kernel == "fa4":
            # forced, FA4 that cannot run is an error (``decide``); by the rule, the Triton kernel runs instead
            forced = parse_setting(setting)[layout] == "fa4"
            text += f"; {'an error' if forced else 'triton'} on GPUs other than compute capability 9.x / 10.x"
        report[layout] = text
    report["other"] = (f"triton for float32 inputs and head dims not measured with FA4 (e.g. DeepSeek MLA 192 / 128)"
                       f"; {ENV}=auto|triton|fa4|causal=<impl>,window=<impl> overrides (now: {setting})")
    return report
