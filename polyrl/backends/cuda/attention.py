"""``triton_varlen_attention``: the cuda backend's packed attention (causal, window, sinks, GQA), fwd + bwd; and
``cuda_varlen_attention``, the backend's kernel slot, which runs FlashAttention-4 or this kernel per call
(polyrl.backends.cuda.attention_choice).

An ``autograd.Function`` over the Triton kernels in ``kernels/``. Contract (polyrl.core.attention):
q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv], cu_seqlens int32 [N+1]; window W = the W most recent keys of
the document, the query itself included; sinks [Hq] (fp32 math, unscaled). Returns [T, Hq, Dv] in q's dtype.

Design choices:
- No host synchronisation: documents reach the kernels as per-token ``doc_start`` / ``doc_end`` arrays built
  on the device from cu_seqlens (``searchsorted``), so the grid depends only on T and the shapes.
- The forward saves O' and LSE' (fp32); the backward recomputes P' from them (flash backward on O', LSE').
- dsink = -sum_i p_sink_i D_i, reduced by torch's fixed-order sum: deterministic like the rest.
- Dv != D (DeepSeek MLA: 192 / 128): D and Dv are separate constexprs padded to powers of two with masked
  loads; see kernels/README.md for the cost of that route and the faster split it leaves open.

Kernel paths (``KernelOptions``; each defaults to the first value — the fastest measured on an H200, 2026-11-30,
docs/performance.md — and can be set per call with ``options=`` or per process with an environment variable
read at every call):
- ``bwd`` (``POLYRL_ATTN_BWD``): ``two_pass`` = deterministic dK/dV kernel + dQ kernel; ``atomic`` = one fused
  kernel adding dQ into an fp32 buffer with atomics (kernels/backward_fused.py): fewer matmuls, dQ and dsink
  not bitwise reproducible, one more fp32 [T, Hq, D] buffer.
- ``window_tiles`` (``POLYRL_ATTN_WINDOW_TILES``): ``band`` = for windows up to ``BAND_MAX_WINDOW``, one masked
  loop over the exact band (kernels/bounds.py; window 128 at 16k tokens: 0.31 / 1.21 ms fwd / fwd+bwd against
  0.36 / 1.36); ``aligned`` = BLOCK_N-aligned key ranges split in masked edge / interior / diagonal.
- ``configs`` (``POLYRL_ATTN_CONFIGS``): ``first`` = each kernel's first Hopper candidate, or its measured pick for
  the shape class on compute capability 9.x (kernels/configs.py, ``HOPPER_PICKS``); ``table`` = the
  per-head-dim table of kernels/configs.py, and q tiles launched heaviest first (forward, dQ).
  ``POLYRL_TRITON_AUTOTUNE=1`` searches whichever list is active.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from polyrl.backends.cuda.attention_choice import choose
from polyrl.backends.cuda.fa4 import fa4_varlen_attention
from polyrl.backends.cuda.kernels.backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, bwd_preprocess_kernel
from polyrl.backends.cuda.kernels.backward_fused import attn_bwd_fused_kernel
from polyrl.backends.cuda.kernels.configs import measured_pick, table_configs
from polyrl.backends.cuda.kernels.forward import attn_fwd_kernel, prune_rows
from polyrl.backends.cuda.launching import launch
from polyrl.backends.cuda.per_batch import LastBatch
from polyrl.backends.cuda.tma import ensure_allocator, tma_loadable
from polyrl.core.errors import BadInputError

LOG2E = 1.4426950408889634
# The band path covers windows up to this many keys; longer windows keep the aligned ranges (their interior
# tiles need no mask, which outweighs the exact bounds).
BAND_MAX_WINDOW = 256
# option field -> (environment variable, allowed values; the first is the default)
OPTION_CHOICES: dict[str, tuple[str, tuple[str, ...]]] = {
    "bwd": ("POLYRL_ATTN_BWD", ("two_pass", "atomic")),
    "window_tiles": ("POLYRL_ATTN_WINDOW_TILES", ("band", "aligned")),
    "configs": ("POLYRL_ATTN_CONFIGS", ("first", "table")),
}


@dataclass(frozen=True)
class KernelOptions:
    """Which kernel path runs (module docstring). Unknown values are refused with the field's name."""

    bwd: str = "two_pass"
    window_tiles: str = "band"
    configs: str = "first"

    def __post_init__(self) -> None:
        for field, (env, allowed) in OPTION_CHOICES.items():
            value = getattr(self, field)
            if value not in allowed:
                raise BadInputError(f"attention kernel option {field} ({env}) = {value!r}: "
                                    f"expected one of {', '.join(allowed)}")

    @classmethod
    def from_env(cls) -> KernelOptions:
        """Options from POLYRL_ATTN_BWD / POLYRL_ATTN_WINDOW_TILES / POLYRL_ATTN_CONFIGS (unset: default)."""
        return cls(**{f: os.environ.get(env) or allowed[0] for f, (env, allowed) in OPTION_CHOICES.items()})

    def band(self, window: int | None) -> bool:
        return self.window_tiles == "band" and window is not None and window <= BAND_MAX_WINDOW

    @property
    def heavy_first(self) -> bool:
        """The table path also launches q tiles last-first (forward, dQ): causal tiles near a document's end
        see the most keys, and starting them first leaves light tiles, not heavy ones, for the last wave."""
        return self.configs == "table"


# Autotuners over the table's candidates, built on first use (only under POLYRL_TRITON_AUTOTUNE=1).
_TABLE_TUNERS: dict[tuple, triton.runtime.Autotuner] = {}
_TUNE_KEY = ["D", "DV", "G_P", "HAS_WINDOW", "HAS_SINK", "W", "BAND"]


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def _launch_one(kernel, grid, args: tuple, meta: dict, config: triton.Config,
                tma_tensors: tuple[torch.Tensor, ...] = ()) -> None:
    """The Triton function under ``kernel``'s autotuner with one config (its row tile widened to the GQA group).
    A config's ``TMA`` variant runs only where ``tma_tensors`` (the tensors its descriptors read) qualify
    (polyrl.backends.cuda.tma.tma_loadable, checked only for such a config); otherwise the same config runs its
    pointer loads."""
    (config,) = prune_rows([config], meta)
    kwargs = {**meta, **config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
    if kwargs.get("TMA"):
        if tma_tensors and tma_loadable(*tma_tensors):
            if args[0].device.type == "cuda":
                ensure_allocator()
        else:
            kwargs["TMA"] = False
    launch(kernel.fn, grid, args, kwargs)


def _launch(kernel, name: str, grid, args: tuple, meta: dict, options: KernelOptions, reset_to_zero=None,
            tma_tensors: tuple[torch.Tensor, ...] = ()) -> None:
    """Run ``kernel`` (an Autotuner over its first-config list; a measured pick of
    polyrl.backends.cuda.kernels.configs.HOPPER_PICKS instead where one applies) or, with ``configs="table"``,
    the same Triton function with the table's config for (name, head-dim class, band); several candidates
    (autotuning on) go through an Autotuner of their own, cached per candidate list. ``tma_tensors``: what a pick's
    ``TMA`` variant would read through descriptors (``_launch_one``)."""
    if options.configs == "first":
        pick = measured_pick(name, meta["D"], meta["DV"], meta["HAS_WINDOW"], _capability(args[0].device))
        if pick is None:
            launch(kernel, grid, args, meta)
        else:
            _launch_one(kernel, grid, args, meta, pick, tma_tensors)
        return
    configs = table_configs(name, meta["D"], meta["DV"], meta["BAND"])
    if len(configs) == 1:
        _launch_one(kernel, grid, args, meta, configs[0])
        return
    tuner_key = (name, tuple(str(c) for c in configs))
    if tuner_key not in _TABLE_TUNERS:
        _TABLE_TUNERS[tuner_key] = triton.autotune(
            configs=configs, key=[k for k in _TUNE_KEY if k in kernel.fn.arg_names],
            prune_configs_by={"early_config_prune": prune_rows}, cache_results=True,
            reset_to_zero=reset_to_zero)(kernel.fn)
    launch(_TABLE_TUNERS[tuner_key], grid, args, meta)


def _compute_doc_bounds(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    cu = cu_seqlens.to(torch.int32)
    pos = torch.arange(T, device=cu.device, dtype=torch.int32)
    doc = torch.searchsorted(cu[1:], pos, right=True)  # document index of each token
    return cu[doc].contiguous(), cu[doc + 1].contiguous()


_DOC_BOUNDS = LastBatch(_compute_doc_bounds)


def _doc_bounds(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token document start and end (int32 [T]), computed on the device without a host sync, once per forward
    (polyrl.backends.cuda.per_batch: every layer passes the same cu_seqlens object)."""
    return _DOC_BOUNDS.get(cu_seqlens, T)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs (interpreter tests, fp32 parity runs) get exact fp32 dots; bf16/fp16 use tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, window, sinks, options):
        T, Hq, D = q.shape
        Hkv, Dv = k.shape[1], v.shape[2]
        if Hq % Hkv:
            raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
        G = Hq // Hkv
        G_P = triton.next_power_of_2(G)
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        doc_start, doc_end = _doc_bounds(cu_seqlens, T)
        o = torch.empty((T, Hq, Dv), device=q.device, dtype=q.dtype)
        lse = torch.empty((T, Hq), device=q.device, dtype=torch.float32)
        has_sink = sinks is not None
        sink_arg = sinks.float().contiguous() if has_sink else lse  # dummy pointer when absent
        W = int(window) if window is not None else 0
        if T > 0:
            def grid(meta):
                return (triton.cdiv(T, max(meta["BLOCK_M"] // G_P, 1)), Hkv)

            _launch(attn_fwd_kernel, "fwd", grid, (
                q, k, v, o, lse, sink_arg, doc_start,
                T, W, G, scale * LOG2E,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0),
                o.stride(1),
                Hq), dict(D=D, DV=Dv, G_P=G_P,
                          BLOCK_D=triton.next_power_of_2(D), BLOCK_DV=triton.next_power_of_2(Dv),
                          HAS_WINDOW=window is not None, HAS_SINK=has_sink, DOT_PREC=_dot_precision(q.dtype),
                          BAND=options.band(window), HEAVY_FIRST=options.heavy_first), options,
                    tma_tensors=(k, v))
        ctx.save_for_backward(q, k, v, o, lse, doc_start, doc_end, sinks if has_sink else None)
        ctx.scale, ctx.window, ctx.has_sink, ctx.options = scale, window, has_sink, options
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, doc_start, doc_end, sinks = ctx.saved_tensors
        T, Hq, D = q.shape
        Hkv, Dv = k.shape[1], v.shape[2]
        G = Hq // Hkv
        G_P = triton.next_power_of_2(G)
        do = _last_dim_contiguous(do)
        W = int(ctx.window) if ctx.window is not None else 0
        has_window = ctx.window is not None
        prec = _dot_precision(q.dtype)
        options = ctx.options
        band = options.band(ctx.window)
        atomic = options.bwd == "atomic"
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        delta = torch.empty((T, Hq), device=q.device, dtype=torch.float32)
        if atomic:  # fp32 accumulators the fused kernel adds into (kernels/backward_fused.py)
            dq_acc = torch.zeros((T, Hq, D), device=q.device, dtype=torch.float32)
            d_exact = torch.zeros_like(delta)
        else:
            dq = torch.empty_like(q)
            d_exact = torch.empty_like(delta)
        BLOCK_DV = triton.next_power_of_2(Dv)
        BLOCK_D = triton.next_power_of_2(D)
        if T > 0:
            R = T * Hq
            block_r = 64 if BLOCK_DV <= 128 else 16
            # o is contiguous [T, Hq, Dv]; do may be any [T, Hq, Dv] with unit last stride and rows uniform.
            if do.stride(0) != Hq * do.stride(1):
                do = do.contiguous()
            launch(bwd_preprocess_kernel, (triton.cdiv(R, block_r),), (o, do, delta, R, o.stride(1), do.stride(1)),
                   dict(DV=Dv, BLOCK_R=block_r, BLOCK_DV=BLOCK_DV))
            meta = dict(D=D, DV=Dv, G_P=G_P, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, HAS_WINDOW=has_window,
                        DOT_PREC=prec, BAND=band)

            def grid_dq(meta):
                return (triton.cdiv(T, max(meta["BLOCK_M"] // G_P, 1)), Hkv)

            def grid_kv(meta):
                return (triton.cdiv(T, meta["BLOCK_N"]), Hkv)

            def grid_dkdv(meta):  # 1-D: the kernel maps a program to (key block, kv head), see HEADS_INNER
                return (triton.cdiv(T, meta["BLOCK_N"]) * Hkv,)

            if atomic:
                _launch(attn_bwd_fused_kernel, "fused", grid_kv, (
                    q, k, v, do, lse, delta, dk, dv, dq_acc, d_exact, doc_start, doc_end,
                    T, W, G, ctx.scale * LOG2E, ctx.scale,
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0),
                    do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                    Hq), meta, options, reset_to_zero=["dq_acc_ptr", "d_exact_ptr"])
            else:
                _launch(attn_bwd_dq_kernel, "dq", grid_dq, (
                    q, k, v, do, lse, delta, dq, doc_start, d_exact,
                    T, W, G, ctx.scale * LOG2E, ctx.scale,
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0),
                    do.stride(1), dq.stride(0), dq.stride(1),
                    Hq), dict(meta, HEAVY_FIRST=options.heavy_first), options, tma_tensors=(k, v))
                _launch(attn_bwd_dkdv_kernel, "dkdv", grid_dkdv, (
                    q, k, v, do, lse, delta, dk, dv, doc_start, doc_end,
                    T, W, G, ctx.scale * LOG2E, ctx.scale,
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0),
                    do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                    Hq), meta, options, tma_tensors=(q, do))
        if atomic:
            dq = dq_acc.mul_(ctx.scale).to(q.dtype)  # fp32 inputs: the buffer itself
        dsink = None
        if ctx.has_sink and ctx.needs_input_grad[6]:
            # p_sink_i = exp(s_h - LSE'_i); dsink_h = -sum_i p_sink_i * D_i (fp32, fixed-order reduction), with
            # D_i = dO_i . O'_i from the dQ kernel's fp32 P' dP row sums (not from O' rounded to bf16).
            p_sink = torch.exp(sinks.float()[None, :] - lse)
            dsink = -(p_sink * d_exact).sum(0).to(sinks.dtype)
        return dq, dk, dv, None, None, None, dsink, None


def _check_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> None:
    """What both entry points refuse before any kernel runs: other than [T, H, D] tensors, a window below 1."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("q, k, v must be [T, H, D]")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")


def triton_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    options: KernelOptions | None = None,
) -> torch.Tensor:
    """Packed causal attention with optional window and sinks; see the module docstring for the contract.

    ``options``: the kernel paths to run; None reads them from the environment (``KernelOptions.from_env``)."""
    _check_call(q, k, v, window)
    if options is None:
        options = KernelOptions.from_env()
    return _VarlenAttention.apply(q, k, v, cu_seqlens, float(scale), window, sinks, options)


def cuda_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    options: KernelOptions | None = None,
) -> torch.Tensor:
    """The cuda backend's attention (``CudaBackend.attention_kernel``): FlashAttention-4 where the rule of
    polyrl.backends.cuda.attention_choice picks it for this call's layout, dtype, head dims and GPU (full-causal
    bf16 layers at the measured head dims on compute capability 9.x / 10.x, FA4 installed), the Triton kernel
    otherwise; ``POLYRL_CUDA_ATTENTION`` overrides. ``options`` apply to the Triton kernel only."""
    _check_call(q, k, v, window)
    # An empty batch has nothing to run: the Triton kernel returns its empty output without a launch.
    if q.shape[0] > 0 and choose(q, v, window, sinks).kernel == "fa4":
        return fa4_varlen_attention(q, k, v, cu_seqlens, scale=scale, window=window, sinks=sinks)
    return triton_varlen_attention(q, k, v, cu_seqlens, scale=scale, window=window, sinks=sinks, options=options)
