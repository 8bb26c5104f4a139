"""``triton_decode_attention``: the cuda backend's decode attention (``CudaBackend.decode_attention_kernel``), the
generation form of polyrl.core.attention.decode_attention that the hf engine's decode steps run: one Triton launch
per layer call (kernels/decode.py) instead of the ~47 torch ops of the dense reference.

Contract (polyrl.core.attention.decode_attention, validated there): q [B, Sq, Hq, D], k_cache [B, Sk, Hkv, D],
v_cache [B, Sk, Hkv, Dv] (Dv may differ from D), key_padding_mask None or bool [B, Sk] (True = real), scale, window
W (the W most recent cache slots, the query's own included), sinks None or [Hq] (unscaled, fp32 math, denominator
only); query i at cache slot Sk - Sq + i; a query with no visible key returns zeros; out [B, Sq, Hq, Dv] in q's dtype,
fp32 accumulation.

What runs (``decode_route``), decided from dtypes, flags and the environment only — never from tensor values, so
the wrapper never synchronises with the device and the grid depends only on shapes:

- the Triton kernel for float32 / bfloat16 / float16 inputs when no gradient is wanted (the engine generates under
  ``torch.no_grad()``);
- the core reference (``reference_decode_attention``: differentiable, dense fp32) when autograd is on and any of q,
  k_cache, v_cache, sinks requires grad (the kernel has no backward), for float64 (the kernel's math is fp32), and
  when ``POLYRL_CUDA_DECODE=reference`` (the same-run before/after of the launch count: bench/profile_step.py).

``POLYRL_CUDA_DECODE`` = ``triton`` (default) | ``reference``, read at every call; another value is refused
(``BadInputError``, one line). This module imports no Triton: the kernel module is imported on the first launch,
so ``polyrl backends`` can read ``decode_report`` without a vendor import.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from polyrl.core.attention.reference import reference_decode_attention
from polyrl.core.errors import BadInputError

ENV = "POLYRL_CUDA_DECODE"
CHOICES = ("triton", "reference")  # the first is the default
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def decode_setting() -> str:
    """``POLYRL_CUDA_DECODE`` (unset or empty: ``triton``); another value is refused in one line."""
    value = os.environ.get(ENV) or CHOICES[0]
    if value not in CHOICES:
        raise BadInputError(f"{ENV}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def decode_route(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sinks: torch.Tensor | None) -> str:
    """``"triton"``, or why the reference runs this call (``"reference (...)"``). Reads dtypes and autograd flags
    only (no tensor values: no host sync)."""
    if decode_setting() == "reference":
        return f"reference ({ENV}=reference)"
    if q.dtype not in KERNEL_DTYPES:
        return f"reference ({str(q.dtype).removeprefix('torch.')}: the kernel computes in float32)"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, sinks)):
        return "reference (an input requires grad: the kernel is forward only)"
    return "triton"


def decode_report() -> dict[str, str]:
    """{case: "what runs (why)"} for ``polyrl backends`` (``kernel_choices``). No device, no vendor import."""
    try:
        setting = decode_setting()
    except BadInputError as exc:
        return {"all": f"error ({exc})"}
    if setting == "reference":
        return {"all": f"reference ({ENV}=reference)"}
    return {"float32 / bfloat16 / float16, no grad (generation)": "triton (one launch per layer call)",
            "an input requires grad, or float64": "reference (the kernel is forward only, fp32 math)",
            "override": f"{ENV}=triton|reference (now: {setting})"}


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def launch_decode_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The Triton kernel alone, whatever ``decode_route`` says: forward only (the result carries no gradient), for
    float32 / bfloat16 / float16 inputs. Tests call it to be sure the kernel, not the fallback, is what they check."""
    import triton

    from polyrl.backends.cuda.kernels.decode import decode_config, decode_fwd_kernel

    B, Sq, Hq, D = q.shape
    Sk, Hkv, Dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    # transformers hands q, k, v head-major ([B, H, S, D] transposed to [B, S, H, D]): strides, no copy
    q, k_cache, v_cache = (_last_dim_contiguous(x) for x in (q, k_cache, v_cache))
    out = torch.empty((B, Sq, Hq, Dv), device=q.device, dtype=q.dtype)
    if out.numel() == 0:
        return out
    G = Hq // Hkv
    G_P = max(triton.next_power_of_2(G), 16)
    BLOCK_D = max(triton.next_power_of_2(D), 16)
    BLOCK_DV = max(triton.next_power_of_2(Dv), 16)
    has_mask = key_padding_mask is not None
    if has_mask:
        mask = key_padding_mask
        if mask.dtype != torch.bool or mask.device != q.device:
            mask = mask.to(device=q.device, dtype=torch.bool)
        # read as bytes (the same memory, no copy): an int8 load is the plain path on every Triton backend, where
        # a bool pointer goes through Triton's i1 special case
        mask = mask.view(torch.uint8)
        mask_args: tuple[Any, ...] = (mask, mask.stride(0), mask.stride(1))
    else:
        mask_args = (q, 0, 0)  # dummy pointer, never read
    has_sink = sinks is not None
    sink_arg = sinks.contiguous() if has_sink else q  # loaded and cast to fp32 in the kernel; dummy when absent
    config = decode_config(BLOCK_D, BLOCK_DV)
    decode_fwd_kernel[(B * Sq, Hkv)](
        q, k_cache, v_cache, out, mask_args[0], sink_arg,
        Sq, Sk, int(window) if window is not None else 0, G, float(scale) * 1.4426950408889634,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        mask_args[1], mask_args[2],
        D=D, DV=Dv, G_P=G_P, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
        HAS_WINDOW=window is not None, HAS_MASK=has_mask, HAS_SINK=has_sink,
        # fp32 inputs (interpreter tests, fp32 runs) get exact fp32 dots; bf16 / fp16 use tensor cores
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_N=config["BLOCK_N"], num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return out


def triton_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The cuda backend's decode attention (contract in the module docstring). Runs the Triton kernel (one launch,
    forward only) for float32 / bfloat16 / float16 inputs without gradients; falls back to the core reference
    (``reference_decode_attention``, differentiable) when autograd is on and q, k_cache, v_cache or sinks require
    grad, for float64, and under ``POLYRL_CUDA_DECODE=reference``. No host synchronisation either way."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if decode_route(q, k_cache, v_cache, sinks) != "triton":
        return reference_decode_attention(q, k_cache, v_cache, key_padding_mask=key_padding_mask, scale=scale,
                                          window=window, sinks=sinks)
    return launch_decode_kernel(q, k_cache, v_cache, key_padding_mask=key_padding_mask, scale=scale, window=window,
                                sinks=sinks)
