"""``triton_varlen_attention``: the cuda backend's packed attention (causal, window, sinks, GQA), fwd + bwd.

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
"""

from __future__ import annotations

import torch
import triton

from polyrl.backends.cuda.kernels.backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, bwd_preprocess_kernel
from polyrl.backends.cuda.kernels.forward import attn_fwd_kernel

LOG2E = 1.4426950408889634


_last_bounds: list = [None, -1, 0, None]  # cu_seqlens object, its version, T, (doc_start, doc_end)


def _doc_bounds(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token document start and end (int32 [T]), computed on the device without a host sync.

    Every layer of a forward receives the same ``cu_seqlens`` object: the bounds of the last one are kept
    (identity, unchanged in place, same T) so they are computed once per forward, not once per layer."""
    c, version, t_last, bounds = _last_bounds
    if c is cu_seqlens and version == cu_seqlens._version and t_last == T:
        return bounds
    cu = cu_seqlens.to(torch.int32)
    pos = torch.arange(T, device=cu.device, dtype=torch.int32)
    doc = torch.searchsorted(cu[1:], pos, right=True)  # document index of each token
    bounds = cu[doc].contiguous(), cu[doc + 1].contiguous()
    _last_bounds[:] = [cu_seqlens, cu_seqlens._version, T, bounds]
    return bounds


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs (interpreter tests, fp32 parity runs) get exact fp32 dots; bf16/fp16 use tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, window, sinks):
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

            attn_fwd_kernel[grid](
                q, k, v, o, lse, sink_arg, doc_start,
                T, W, G, scale * LOG2E,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0),
                o.stride(1),
                Hq, D=D, DV=Dv, G_P=G_P,
                BLOCK_D=triton.next_power_of_2(D), BLOCK_DV=triton.next_power_of_2(Dv),
                HAS_WINDOW=window is not None, HAS_SINK=has_sink, DOT_PREC=_dot_precision(q.dtype),
            )
        ctx.save_for_backward(q, k, v, o, lse, doc_start, doc_end, sinks if has_sink else None)
        ctx.scale, ctx.window, ctx.has_sink = scale, window, has_sink
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
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        delta = torch.empty((T, Hq), device=q.device, dtype=torch.float32)
        d_exact = torch.empty_like(delta)
        BLOCK_DV = triton.next_power_of_2(Dv)
        BLOCK_D = triton.next_power_of_2(D)
        if T > 0:
            R = T * Hq
            block_r = 64 if BLOCK_DV <= 128 else 16
            # o is contiguous [T, Hq, Dv]; do may be any [T, Hq, Dv] with unit last stride and rows uniform.
            if do.stride(0) != Hq * do.stride(1):
                do = do.contiguous()
            bwd_preprocess_kernel[(triton.cdiv(R, block_r),)](
                o, do, delta, R, o.stride(1), do.stride(1), DV=Dv, BLOCK_R=block_r, BLOCK_DV=BLOCK_DV)

            def grid_dq(meta):
                return (triton.cdiv(T, max(meta["BLOCK_M"] // G_P, 1)), Hkv)

            attn_bwd_dq_kernel[grid_dq](
                q, k, v, do, lse, delta, dq, doc_start, d_exact,
                T, W, G, ctx.scale * LOG2E, ctx.scale,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0),
                do.stride(1), dq.stride(0), dq.stride(1),
                Hq, D=D, DV=Dv, G_P=G_P, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
                HAS_WINDOW=has_window, DOT_PREC=prec,
            )

            def grid_kv(meta):
                return (triton.cdiv(T, meta["BLOCK_N"]), Hkv)

            attn_bwd_dkdv_kernel[grid_kv](
                q, k, v, do, lse, delta, dk, dv, doc_start, doc_end,
                T, W, G, ctx.scale * LOG2E, ctx.scale,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0),
                do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                Hq, D=D, DV=Dv, G_P=G_P, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
                HAS_WINDOW=has_window, DOT_PREC=prec,
            )
        dsink = None
        if ctx.has_sink and ctx.needs_input_grad[6]:
            # p_sink_i = exp(s_h - LSE'_i); dsink_h = -sum_i p_sink_i * D_i (fp32, fixed-order reduction), with
            # D_i = dO_i . O'_i from the dQ kernel's fp32 P' dP row sums (not from O' rounded to bf16).
            p_sink = torch.exp(sinks.float()[None, :] - lse)
            dsink = -(p_sink * d_exact).sum(0).to(sinks.dtype)
        return dq, dk, dv, None, None, None, dsink


def triton_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Packed causal attention with optional window and sinks; see the module docstring for the contract."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("q, k, v must be [T, H, D]")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    return _VarlenAttention.apply(q, k, v, cu_seqlens, float(scale), window, sinks)
