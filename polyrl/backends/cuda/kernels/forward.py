"""Forward kernel: packed causal attention with window, sinks and GQA sharing, one pass.

Program = (q tile, kv head). A q tile is ``BLOCK_T`` consecutive tokens (in global packed positions) times the
``G_P`` query heads of kv head ``kvh``: row r is token ``a + r // G_P`` of query head ``kvh * G + r % G_P``.
Since q is [T, Hq, D] with the heads of a group adjacent, a row block is a strided gather of contiguous
``G * D`` chunks. Each K/V tile is loaded once for the whole group.

Documents: ``doc_start[t]`` (int32 [T]) is the first token of t's document, so a tile may straddle two
documents and is simply masked there; nothing needs the number of documents or their maximum length on the host.
Key j is visible to row (t, h) iff ``doc_start[t] <= j <= t`` and ``t - j < W``.

The key loop is split in three ranges of BLOCK_N-aligned key tiles (no tile outside the band is visited):
masked lower edge (window start / document start), unmasked interior, masked diagonal. With ``BAND`` (the
default for windows up to 256 keys; ``POLYRL_ATTN_WINDOW_TILES=aligned`` turns it off) it is one masked loop over
the exact band instead (bounds.py).

Sinks: the running max and sum start at the sink (``m = s * log2 e``, ``l = 1``), so the sink joins the
denominator with no extra pass and ``m`` is never -inf. Without sinks ``m`` starts at a finite -1e30 for the
same reason. Output LSE' = log(sum_j e^{l_ij} + e^{s}) in fp32 natural-log units, shape [T, Hq].
"""

from __future__ import annotations

import triton
import triton.language as tl

from polyrl.backends.cuda.kernels.bounds import band_key_range, key_ranges
from polyrl.backends.cuda.kernels.configs import forward_configs


def prune_rows(configs, named_args, **kwargs):
    """Keep configs whose row tile holds at least one token of every head of the group."""
    g_p = named_args["G_P"] if "G_P" in named_args else kwargs["G_P"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] >= g_p]
    if kept:
        return kept
    c = configs[0]
    return [triton.Config({**c.kwargs, "BLOCK_M": g_p}, num_warps=c.num_warps, num_stages=c.num_stages)]


@triton.jit
def kv_sources(k_ptr, v_ptr, kvh, T, stride_kt, stride_kh, stride_vt, stride_vh, D: tl.constexpr, DV: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, TMA: tl.constexpr):
    """Where a key walk reads kv head ``kvh``'s K and V rows: the heads' base pointers, or with ``TMA`` descriptors
    over their [T, D] matrices (BLOCK_N-row boxes, filled with zeros past T and past D, so the TMA unit loads each
    tile into shared memory and the pipelined walk keeps no per-element addresses in registers). The launcher asks
    for TMA only where the tensors meet its rules (polyrl.backends.cuda.tma)."""
    if TMA:
        k_src = tl.make_tensor_descriptor(k_ptr + kvh * stride_kh, shape=[T, D], strides=[stride_kt, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_ptr + kvh * stride_vh, shape=[T, DV], strides=[stride_vt, 1],
                                          block_shape=[BLOCK_N, BLOCK_DV])
    else:
        k_src = k_ptr + kvh * stride_kh
        v_src = v_ptr + kvh * stride_vh
    return k_src, v_src


@triton.jit
def load_kv_tile(k_src, v_src, start_n, j, T, stride_kt, stride_vt, offs_d, offs_dv, D: tl.constexpr,
                 DV: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """K (BN, D) and V (BN, DV) of keys ``j`` = start_n + [0, BN) from ``kv_sources``; rows past T are zeros."""
    if TMA:
        k = k_src.load([start_n, 0])
        v = v_src.load([start_n, 0])
    else:
        if MASKED:
            kmask = (j[:, None] < T) & (offs_d[None, :] < D)
            vmask = (j[:, None] < T) & (offs_dv[None, :] < DV)
        else:
            kmask = offs_d[None, :] < D
            vmask = offs_dv[None, :] < DV
        k = tl.load(k_src + j[:, None] * stride_kt + offs_d[None, :], mask=kmask, other=0.0)  # (BN, D)
        v = tl.load(v_src + j[:, None] * stride_vt + offs_dv[None, :], mask=vmask, other=0.0)  # (BN, DV)
    return k, v


@triton.jit
def _attn_tile(acc, l_i, m_i, q, t_row, ds_row, k_ptrs_base, v_ptrs_base, start_n, T, W,
               stride_kt, stride_vt, qk_scale,
               offs_n, offs_d, offs_dv, D: tl.constexpr, DV: tl.constexpr,
               MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    j = start_n + offs_n  # (BN,)
    k, v = load_kv_tile(k_ptrs_base, v_ptrs_base, start_n, j, T, stride_kt, stride_vt, offs_d, offs_dv, D, DV,
                        MASKED, TMA)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # (M, BN), log2 units
    if MASKED:
        vis = (j[None, :] <= t_row[:, None]) & (j[None, :] >= ds_row[:, None])
        if HAS_WINDOW:
            vis = vis & (t_row[:, None] - j[None, :] < W)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.autotune(configs=forward_configs(), key=["D", "DV", "G_P", "HAS_WINDOW", "HAS_SINK", "W", "BAND"],
                 prune_configs_by={"early_config_prune": prune_rows}, cache_results=True)
@triton.jit(do_not_specialize=["T"])
def attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sink_ptr, doc_start_ptr,
    T, W, G, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    HQ, D: tl.constexpr, DV: tl.constexpr,
    G_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr, DOT_PREC: tl.constexpr, BAND: tl.constexpr,
    HEAVY_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr = False,
):
    BLOCK_T: tl.constexpr = BLOCK_M // G_P
    pid_t = tl.program_id(0)
    if HEAVY_FIRST:  # causal: the last q tiles see the most keys; start them first, end on light ones
        pid_t = tl.num_programs(0) - 1 - pid_t
    kvh = tl.program_id(1)
    a = pid_t * BLOCK_T  # first token of the tile

    offs_r = tl.arange(0, BLOCK_M)
    t_row = a + offs_r // G_P  # (M,) token of each row
    g_row = offs_r % G_P
    h_row = kvh * G + g_row  # query head of each row
    row_ok = (t_row < T) & (g_row < G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q = tl.load(q_ptr + t_row[:, None] * stride_qt + h_row[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    ds_row = tl.load(doc_start_ptr + t_row, mask=t_row < T, other=0)

    if HAS_SINK:
        sink = tl.load(sink_ptr + h_row, mask=row_ok, other=0.0).to(tl.float32)
        m_i = sink * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    k_base, v_base = kv_sources(k_ptr, v_ptr, kvh, T, stride_kt, stride_kh, stride_vt, stride_vh, D, DV, BLOCK_N,
                                BLOCK_D, BLOCK_DV, TMA)
    if BAND:
        # Short window: one masked loop over the exact band (bounds.py).
        k_lo, k_hi = band_key_range(doc_start_ptr, a, T, W, BLOCK_T)
        for start_n in range(k_lo, k_hi, BLOCK_N):
            acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, t_row, ds_row, k_base, v_base, start_n, T, W,
                                       stride_kt, stride_vt, qk_scale, offs_n, offs_d, offs_dv, D, DV,
                                       True, HAS_WINDOW, BLOCK_D, BLOCK_DV, DOT_PREC, TMA)
    else:
        # Key range of the tile, in three BLOCK_N-aligned pieces (masked edge, unmasked interior, masked diagonal).
        k_start, s1, s2, k_end = key_ranges(doc_start_ptr, a, T, W, BLOCK_T, BLOCK_N, HAS_WINDOW)
        for start_n in range(k_start, s1, BLOCK_N):
            acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, t_row, ds_row, k_base, v_base, start_n, T, W,
                                       stride_kt, stride_vt, qk_scale, offs_n, offs_d, offs_dv, D, DV,
                                       True, HAS_WINDOW, BLOCK_D, BLOCK_DV, DOT_PREC, TMA)
        for start_n in range(s1, s2, BLOCK_N):
            acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, t_row, ds_row, k_base, v_base, start_n, T, W,
                                       stride_kt, stride_vt, qk_scale, offs_n, offs_d, offs_dv, D, DV,
                                       False, HAS_WINDOW, BLOCK_D, BLOCK_DV, DOT_PREC, TMA)
        for start_n in range(s2, k_end, BLOCK_N):
            acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, t_row, ds_row, k_base, v_base, start_n, T, W,
                                       stride_kt, stride_vt, qk_scale, offs_n, offs_d, offs_dv, D, DV,
                                       True, HAS_WINDOW, BLOCK_D, BLOCK_DV, DOT_PREC, TMA)

    out = acc / l_i[:, None]
    tl.store(o_ptr + t_row[:, None] * stride_ot + h_row[:, None] * stride_oh + offs_dv[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(lse_ptr + t_row * HQ + h_row, lse, mask=row_ok)
