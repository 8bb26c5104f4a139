"""Opt-in fused backward: dK/dV and dQ in one sweep, dQ accumulated with fp32 atomics (non-deterministic).

The deterministic backward (backward.py) walks the (key tile, q tile) pairs twice: once per key tile for
dK/dV and once per q tile for dQ, so QK^T and dO V^T are computed twice (7 matmuls per tile pair). Here the
dK/dV program also produces its share of dQ, ``dQ_i += dS_ij K_j`` (5 matmuls), and adds it into an fp32
buffer [T, Hq, D] with ``atomic_add``; the caller scales and casts it. The exact row sums
``D_i = sum_j P'_ij dP_ij`` that the sink gradient needs (backward.py computes them in the dQ kernel) are
accumulated the same way into an fp32 [T, Hq] buffer. Both buffers must be zero on entry.

Cost and contract: fp32 additions in a scheduling-dependent order, so dQ and dsink differ between two
identical calls by fp32 rounding (dK and dV are written by one program each and stay bitwise reproducible);
an extra fp32 [T, Hq, D] buffer (256 MiB for 16k tokens x 64 heads x d64) lives during the backward.

Program = (BLOCK_N keys, kv head); rows are (token, head-of-the-group) pairs as everywhere (kernels/README.md).
The q walk is the dK/dV kernel's: three ranges (masked diagonal, unmasked interior, masked tail) or, with
``BAND``, one masked loop over the exact band (bounds.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from polyrl.backends.cuda.kernels.bounds import band_query_range
from polyrl.backends.cuda.kernels.configs import fused_configs
from polyrl.backends.cuda.kernels.forward import prune_rows


@triton.jit
def _fused_tile(dk, dv, k, v, j, a, q_ptr, do_ptr, lse_ptr, delta_ptr, doc_start_ptr, dq_acc_ptr, d_exact_ptr,
                kvh, T, W, G, HQ, stride_qt, stride_qh, stride_dot, stride_doh, qk_scale, offs_r, offs_d, offs_dv,
                D: tl.constexpr, DV: tl.constexpr, G_P: tl.constexpr,
                MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr):
    t_row = a + offs_r // G_P
    g_row = offs_r % G_P
    h_row = kvh * G + g_row
    row_ok = (t_row < T) & (g_row < G)  # padded group rows alias the next kv head's heads: never stored
    q = tl.load(q_ptr + t_row[:, None] * stride_qt + h_row[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)  # (M, D)
    do = tl.load(do_ptr + t_row[:, None] * stride_dot + h_row[:, None] * stride_doh + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)  # (M, DV)
    lse2 = tl.load(lse_ptr + t_row * HQ + h_row, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(delta_ptr + t_row * HQ + h_row, mask=row_ok, other=0.0)
    sT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # (BN, M), log2 units
    if MASKED:
        ds_row = tl.load(doc_start_ptr + t_row, mask=t_row < T, other=0)
        vis = (j[:, None] <= t_row[None, :]) & (j[:, None] >= ds_row[None, :])
        if HAS_WINDOW:
            vis = vis & (t_row[None, :] - j[:, None] < W)
        sT = tl.where(vis, sT, float("-inf"))
    pT = tl.exp2(sT - lse2[None, :])  # (BN, M); 0 for invisible pairs and invalid rows
    dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PREC)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # (BN, M)
    dsT = pT * (dpT - delta[None, :])
    ds_lo = dsT.to(q.dtype)
    dk += tl.dot(ds_lo, q, input_precision=DOT_PREC)
    # This key tile's share of dQ (unscaled) and of the exact row sums, added into the fp32 buffers.
    dq_part = tl.dot(tl.trans(ds_lo), k, input_precision=DOT_PREC)  # (M, D)
    tl.atomic_add(dq_acc_ptr + (t_row[:, None] * HQ + h_row[:, None]) * D + offs_d[None, :], dq_part,
                  mask=row_ok[:, None] & (offs_d[None, :] < D), sem="relaxed")
    tl.atomic_add(d_exact_ptr + t_row * HQ + h_row, tl.sum(pT * dpT, 0), mask=row_ok, sem="relaxed")
    return dk, dv


@triton.autotune(configs=fused_configs(), key=["D", "DV", "G_P", "HAS_WINDOW", "W", "BAND"],
                 prune_configs_by={"early_config_prune": prune_rows}, cache_results=True,
                 reset_to_zero=["dq_acc_ptr", "d_exact_ptr"])
@triton.jit(do_not_specialize=["T"])
def attn_bwd_fused_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dq_acc_ptr, d_exact_ptr,
    doc_start_ptr, doc_end_ptr,
    T, W, G, qk_scale, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    HQ, D: tl.constexpr, DV: tl.constexpr,
    G_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, BAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # dq_acc is a contiguous fp32 [T, HQ, D] buffer (row (t, h) at (t * HQ + h) * D), d_exact fp32 [T, HQ].
    BLOCK_T: tl.constexpr = BLOCK_M // G_P
    c = tl.program_id(0) * BLOCK_N
    kvh = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    j = c + tl.arange(0, BLOCK_N)
    jmask = j < T
    k = tl.load(k_ptr + j[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                mask=jmask[:, None] & (offs_d[None, :] < D), other=0.0)
    v = tl.load(v_ptr + j[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :],
                mask=jmask[:, None] & (offs_dv[None, :] < DV), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    if BAND:
        a_lo, a_hi = band_query_range(doc_end_ptr, c, T, W, BLOCK_N)
        for a in range(a_lo, a_hi, BLOCK_T):
            dk, dv = _fused_tile(dk, dv, k, v, j, a, q_ptr, do_ptr, lse_ptr, delta_ptr, doc_start_ptr, dq_acc_ptr,
                                 d_exact_ptr, kvh, T, W, G, HQ, stride_qt, stride_qh, stride_dot, stride_doh,
                                 qk_scale, offs_r, offs_d, offs_dv, D, DV, G_P, True, HAS_WINDOW, DOT_PREC)
    else:
        # As attn_bwd_dkdv_kernel: masked diagonal, unmasked interior (after the diagonal, inside the first
        # key's document and window), masked tail.
        last_j = tl.minimum(c + BLOCK_N, T) - 1
        hi = tl.load(doc_end_ptr + last_j) - 1
        e_full = tl.load(doc_end_ptr + c)
        if HAS_WINDOW:
            hi = tl.minimum(hi, last_j + W - 1)
            e_full = tl.minimum(e_full, c + W)
        q_start = (c // BLOCK_T) * BLOCK_T
        q_end = hi + 1
        s1 = tl.minimum(tl.maximum(tl.cdiv(c + BLOCK_N - 1, BLOCK_T) * BLOCK_T, q_start), q_end)
        s2 = tl.minimum(tl.maximum((e_full // BLOCK_T) * BLOCK_T, s1), q_end)
        for a in range(q_start, s1, BLOCK_T):
            dk, dv = _fused_tile(dk, dv, k, v, j, a, q_ptr, do_ptr, lse_ptr, delta_ptr, doc_start_ptr, dq_acc_ptr,
                                 d_exact_ptr, kvh, T, W, G, HQ, stride_qt, stride_qh, stride_dot, stride_doh,
                                 qk_scale, offs_r, offs_d, offs_dv, D, DV, G_P, True, HAS_WINDOW, DOT_PREC)
        for a in range(s1, s2, BLOCK_T):
            dk, dv = _fused_tile(dk, dv, k, v, j, a, q_ptr, do_ptr, lse_ptr, delta_ptr, doc_start_ptr, dq_acc_ptr,
                                 d_exact_ptr, kvh, T, W, G, HQ, stride_qt, stride_qh, stride_dot, stride_doh,
                                 qk_scale, offs_r, offs_d, offs_dv, D, DV, G_P, False, HAS_WINDOW, DOT_PREC)
        for a in range(s2, q_end, BLOCK_T):
            dk, dv = _fused_tile(dk, dv, k, v, j, a, q_ptr, do_ptr, lse_ptr, delta_ptr, doc_start_ptr, dq_acc_ptr,
                                 d_exact_ptr, kvh, T, W, G, HQ, stride_qt, stride_qh, stride_dot, stride_doh,
                                 qk_scale, offs_r, offs_d, offs_dv, D, DV, G_P, True, HAS_WINDOW, DOT_PREC)
    dk = dk * scale
    tl.store(dk_ptr + j[:, None] * stride_dkt + kvh * stride_dkh + offs_d[None, :],
             dk.to(dk_ptr.dtype.element_ty), mask=jmask[:, None] & (offs_d[None, :] < D))
    tl.store(dv_ptr + j[:, None] * stride_dvt + kvh * stride_dvh + offs_dv[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=jmask[:, None] & (offs_dv[None, :] < DV))
