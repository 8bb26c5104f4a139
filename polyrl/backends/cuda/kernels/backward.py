"""Backward kernels: preprocess (D = rowsum(dO * O')), dK/dV per kv head, dQ per q tile. No atomics.

The backward is a standard flash backward run on (O', LSE') — docs/background.md §1: with P'_ij = exp(l_ij - LSE'_i),
``dS = P' * (dO V^T - D)``, ``dQ = scale dS K``, ``dK = scale dS^T Q``, ``dV = P'^T dO``; the sink only enters
through LSE' and through ``dsink_h = -sum_i p_sink_i D_i`` (computed by the caller from D and LSE').

dK/dV: program = (BLOCK_N keys, kv head), on a 1-D grid (``HEADS_INNER``: kv head fastest). It walks the q tiles
that can see its keys — rows are (token, head-of-the-group) pairs exactly as in the forward — so the sum over the G
query heads of the group happens in the fp32 dK/dV registers; nothing of size Hq x T x D is ever materialised.
dQ: program = (q tile, kv head), the forward's key walk again. Each output element is written by exactly one
program, so the backward is deterministic. ``BAND`` (the default for windows up to 256 keys, as in the
forward): one masked loop over the exact band instead of the three aligned ranges (bounds.py). backward_fused.py holds the opt-in atomic alternative.
"""

from __future__ import annotations

import triton
import triton.language as tl

from polyrl.backends.cuda.kernels.bounds import band_key_range, band_query_range, key_ranges
from polyrl.backends.cuda.kernels.configs import dkdv_configs, dq_configs
from polyrl.backends.cuda.kernels.forward import kv_sources, load_kv_tile, prune_rows


# R = T * Hq is a runtime value: specialised (R % 16 == 0 or not), each batch's token count would pick one of two
# compiled copies, and a run would compile both
@triton.jit(do_not_specialize=["R"])
def bwd_preprocess_kernel(o_ptr, do_ptr, delta_ptr, R, stride_or, stride_dor,
                          DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr):
    # Rows are (token, head) flattened: o viewed as [T * Hq, Dv] with row stride ``stride_or``.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_DV)
    mask = (rows[:, None] < R) & (cols[None, :] < DV)
    o = tl.load(o_ptr + rows[:, None] * stride_or + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + rows[:, None] * stride_dor + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + rows, tl.sum(o * do, 1), mask=rows < R)


@triton.jit
def _dq_tile(dq, d_exact, q, do, lse2, delta, t_row, ds_row, k_base, v_base, start_n, T, W, stride_kt, stride_vt,
             qk_scale, offs_n, offs_d, offs_dv, D: tl.constexpr, DV: tl.constexpr,
             MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    j = start_n + offs_n
    k, v = load_kv_tile(k_base, v_base, start_n, j, T, stride_kt, stride_vt, offs_d, offs_dv, D, DV, MASKED, TMA)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # (M, BN)
    if MASKED:
        vis = (j[None, :] <= t_row[:, None]) & (j[None, :] >= ds_row[:, None])
        if HAS_WINDOW:
            vis = vis & (t_row[:, None] - j[None, :] < W)
        s = tl.where(vis, s, float("-inf"))
    p = tl.exp2(s - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)  # (M, BN)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
    d_exact += tl.sum(p * dp, 1)
    return dq, d_exact


@triton.autotune(configs=dq_configs(), key=["D", "DV", "G_P", "HAS_WINDOW", "W", "BAND"],
                 prune_configs_by={"early_config_prune": prune_rows}, cache_results=True)
@triton.jit(do_not_specialize=["T"])
def attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, doc_start_ptr, d_exact_ptr,
    T, W, G, qk_scale, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh,
    HQ, D: tl.constexpr, DV: tl.constexpr,
    G_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, BAND: tl.constexpr,
    HEAVY_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr = False,
):
    BLOCK_T: tl.constexpr = BLOCK_M // G_P
    pid_t = tl.program_id(0)
    if HEAVY_FIRST:  # causal: the last q tiles see the most keys; start them first, end on light ones
        pid_t = tl.num_programs(0) - 1 - pid_t
    kvh = tl.program_id(1)
    a = pid_t * BLOCK_T
    offs_r = tl.arange(0, BLOCK_M)
    t_row = a + offs_r // G_P
    g_row = offs_r % G_P
    h_row = kvh * G + g_row
    row_ok = (t_row < T) & (g_row < G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q = tl.load(q_ptr + t_row[:, None] * stride_qt + h_row[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    do = tl.load(do_ptr + t_row[:, None] * stride_dot + h_row[:, None] * stride_doh + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    # Invalid rows get LSE' = +inf, hence P' = 0 and no contribution anywhere.
    lse2 = tl.load(lse_ptr + t_row * HQ + h_row, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(delta_ptr + t_row * HQ + h_row, mask=row_ok, other=0.0)
    ds_row = tl.load(doc_start_ptr + t_row, mask=t_row < T, other=0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    d_exact = tl.zeros([BLOCK_M], tl.float32)

    k_base, v_base = kv_sources(k_ptr, v_ptr, kvh, T, stride_kt, stride_kh, stride_vt, stride_vh, D, DV, BLOCK_N,
                                BLOCK_D, BLOCK_DV, TMA)
    if BAND:
        k_lo, k_hi = band_key_range(doc_start_ptr, a, T, W, BLOCK_T)  # as the forward
        for start_n in range(k_lo, k_hi, BLOCK_N):
            dq, d_exact = _dq_tile(dq, d_exact, q, do, lse2, delta, t_row, ds_row, k_base, v_base, start_n, T, W,
                                   stride_kt, stride_vt, qk_scale, offs_n, offs_d, offs_dv, D, DV, True, HAS_WINDOW,
                                   DOT_PREC, TMA)
    else:
        k_start, s1, s2, k_end = key_ranges(doc_start_ptr, a, T, W, BLOCK_T, BLOCK_N, HAS_WINDOW)  # as the forward
        for start_n in range(k_start, s1, BLOCK_N):
            dq, d_exact = _dq_tile(dq, d_exact, q, do, lse2, delta, t_row, ds_row, k_base, v_base, start_n, T, W,
                                   stride_kt, stride_vt, qk_scale, offs_n, offs_d, offs_dv, D, DV, True, HAS_WINDOW,
                                   DOT_PREC, TMA)
        for start_n in range(s1, s2, BLOCK_N):
            dq, d_exact = _dq_tile(dq, d_exact, q, do, lse2, delta, t_row, ds_row, k_base, v_base, start_n, T, W,
                                   stride_kt, stride_vt, qk_scale, offs_n, offs_d, offs_dv, D, DV, False, HAS_WINDOW,
                                   DOT_PREC, TMA)
        for start_n in range(s2, k_end, BLOCK_N):
            dq, d_exact = _dq_tile(dq, d_exact, q, do, lse2, delta, t_row, ds_row, k_base, v_base, start_n, T, W,
                                   stride_kt, stride_vt, qk_scale, offs_n, offs_d, offs_dv, D, DV, True, HAS_WINDOW,
                                   DOT_PREC, TMA)
    dq = dq * scale
    # D_i recomputed exactly as sum_j P'_ij dP_ij = dO_i . O'_i in fp32 (the preprocess D uses the output
    # rounded to the input dtype, standard for dS; the sink gradient, a sum over T rows, wants the exact one).
    tl.store(d_exact_ptr + t_row * HQ + h_row, d_exact, mask=row_ok)
    tl.store(dq_ptr + t_row[:, None] * stride_dqt + h_row[:, None] * stride_dqh + offs_d[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def _dkdv_rows(a, q_src, do_src, lse_ptr, delta_ptr, kvh, T, G, HQ, stride_qt, stride_qh, stride_dot, stride_doh,
               offs_r, offs_d, offs_dv, D: tl.constexpr, DV: tl.constexpr, G_P: tl.constexpr, TMA: tl.constexpr):
    """The q tile at token ``a``: its rows' q (M, D), dO (M, DV), LSE' in log2 units and D (invalid rows: LSE' =
    +inf, so P' = 0). ``q_src`` / ``do_src``: the tensors' pointers, or with ``TMA`` their [T, Hkv, G, D]
    descriptors (one box of BLOCK_T tokens x G_P heads; the hardware fills rows past T or past G with zeros)."""
    t_row = a + offs_r // G_P
    g_row = offs_r % G_P
    h_row = kvh * G + g_row
    row_ok = (t_row < T) & (g_row < G)
    if TMA:
        q = tl.reshape(q_src.load([a, kvh, 0, 0]), (offs_r.shape[0], offs_d.shape[0]))
        do = tl.reshape(do_src.load([a, kvh, 0, 0]), (offs_r.shape[0], offs_dv.shape[0]))
    else:
        q = tl.load(q_src + t_row[:, None] * stride_qt + h_row[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)  # (M, D)
        do = tl.load(do_src + t_row[:, None] * stride_dot + h_row[:, None] * stride_doh + offs_dv[None, :],
                     mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)  # (M, DV)
    lse2 = tl.load(lse_ptr + t_row * HQ + h_row, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(delta_ptr + t_row * HQ + h_row, mask=row_ok, other=0.0)
    return q, do, lse2, delta


@triton.jit
def _dkdv_update(dk, dv, v, q, do, sT, lse2, delta, DOT_PREC: tl.constexpr):
    """dK/dV of one tile pair from its scaled (and masked) scores sT (BN, M) and the q tile's rows."""
    pT = tl.exp2(sT - lse2[None, :])
    dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PREC)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # (BN, M)
    dsT = pT * (dpT - delta[None, :])
    dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv_tile(dk, dv, k, v, j, a, q_ptr, do_ptr, lse_ptr, delta_ptr, doc_start_ptr, kvh, T, W, G, HQ,
               stride_qt, stride_qh, stride_dot, stride_doh, qk_scale, offs_r, offs_d, offs_dv,
               D: tl.constexpr, DV: tl.constexpr, G_P: tl.constexpr,
               MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    q, do, lse2, delta = _dkdv_rows(a, q_ptr, do_ptr, lse_ptr, delta_ptr, kvh, T, G, HQ, stride_qt, stride_qh,
                                    stride_dot, stride_doh, offs_r, offs_d, offs_dv, D, DV, G_P, TMA)
    sT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # (BN, M)
    if MASKED:
        t_row = a + offs_r // G_P
        ds_row = tl.load(doc_start_ptr + t_row, mask=t_row < T, other=0)
        vis = (j[:, None] <= t_row[None, :]) & (j[:, None] >= ds_row[None, :])
        if HAS_WINDOW:
            vis = vis & (t_row[None, :] - j[:, None] < W)
        sT = tl.where(vis, sT, float("-inf"))
    return _dkdv_update(dk, dv, v, q, do, sT, lse2, delta, DOT_PREC)


@triton.autotune(configs=dkdv_configs(), key=["D", "DV", "G_P", "HAS_WINDOW", "W", "BAND"],
                 prune_configs_by={"early_config_prune": prune_rows}, cache_results=True)
@triton.jit(do_not_specialize=["T"])
def attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, doc_start_ptr, doc_end_ptr,
    T, W, G, qk_scale, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    HQ, D: tl.constexpr, DV: tl.constexpr,
    G_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, BAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr = False,
    TMA: tl.constexpr = False, HEADS_INNER: tl.constexpr = False,
):
    BLOCK_T: tl.constexpr = BLOCK_M // G_P
    # One program per (key block, kv head) on a 1-D grid. By default the key blocks vary fastest (the order of the
    # former 2-D grid), so the last head's heaviest blocks (a document's first, causal) start late and run on
    # alone: a tail of ~14% of the kernel at 4 x 4096 tokens in a model of the launch (bench/launch_tail.py).
    # ``HEADS_INNER``: the kv head varies fastest, so every head's heaviest blocks start first. Not yet timed on a
    # GPU, hence off (bench/attention_sweep.py's heads-inner variants).
    pid = tl.program_id(0)
    if HEADS_INNER:
        n_kv = HQ // G
        kvh = pid % n_kv
        c = (pid // n_kv) * BLOCK_N
    else:
        n_blocks = tl.cdiv(T, BLOCK_N)
        kvh = pid // n_blocks
        c = (pid % n_blocks) * BLOCK_N
    if TMA:
        # q and dO viewed as [T, Hkv, G, D]: a q tile is one box (BLOCK_T tokens, this kv head, G_P heads), loaded
        # by the TMA unit into shared memory, so the pipelined walk holds no per-element addresses in registers.
        # The launcher asks for it only where the tensors meet TMA's rules (16-byte aligned base and strides).
        q_src = tl.make_tensor_descriptor(q_ptr, shape=[T, HQ // G, G, D],
                                          strides=[stride_qt, G * stride_qh, stride_qh, 1],
                                          block_shape=[BLOCK_T, 1, G_P, BLOCK_D])
        do_src = tl.make_tensor_descriptor(do_ptr, shape=[T, HQ // G, G, DV],
                                           strides=[stride_dot, G * stride_doh, stride_doh, 1],
                                           block_shape=[BLOCK_T, 1, G_P, BLOCK_DV])
    else:
        q_src = q_ptr
        do_src = do_ptr
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
            dk, dv = _dkdv_tile(dk, dv, k, v, j, a, q_src, do_src, lse_ptr, delta_ptr, doc_start_ptr, kvh, T, W, G,
                                HQ, stride_qt, stride_qh, stride_dot, stride_doh, qk_scale, offs_r, offs_d, offs_dv,
                                D, DV, G_P, True, HAS_WINDOW, DOT_PREC, TMA)
    else:
        # Queries that can see keys [c, last_j]: tokens [c, hi] with hi bounded by the last key's document end
        # and by the window. Interior q tiles (no mask): after the diagonal, inside the first key's document,
        # and within the window of the first key.
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
            dk, dv = _dkdv_tile(dk, dv, k, v, j, a, q_src, do_src, lse_ptr, delta_ptr, doc_start_ptr, kvh, T, W, G, HQ,
                                stride_qt, stride_qh, stride_dot, stride_doh, qk_scale, offs_r, offs_d, offs_dv,
                                D, DV, G_P, True, HAS_WINDOW, DOT_PREC, TMA)
        if PREFETCH:
            # the interior walk with the next q tile's loads issued before this tile's matmuls (in registers: no
            # cp.async stage, which costs this kernel its registers), so their latency hides behind the math
            qn, don, lsen, deltan = _dkdv_rows(s1, q_src, do_src, lse_ptr, delta_ptr, kvh, T, G, HQ, stride_qt,
                                               stride_qh, stride_dot, stride_doh, offs_r, offs_d, offs_dv, D, DV, G_P, TMA)
            for a in range(s1, s2, BLOCK_T):
                qc, doc, lsec, deltac = qn, don, lsen, deltan
                qn, don, lsen, deltan = _dkdv_rows(a + BLOCK_T, q_src, do_src, lse_ptr, delta_ptr, kvh, T, G, HQ,
                                                   stride_qt, stride_qh, stride_dot, stride_doh, offs_r, offs_d,
                                                   offs_dv, D, DV, G_P, TMA)
                sT = tl.dot(k, tl.trans(qc), input_precision=DOT_PREC) * qk_scale  # (BN, M)
                dk, dv = _dkdv_update(dk, dv, v, qc, doc, sT, lsec, deltac, DOT_PREC)
        else:
            for a in range(s1, s2, BLOCK_T):
                dk, dv = _dkdv_tile(dk, dv, k, v, j, a, q_src, do_src, lse_ptr, delta_ptr, doc_start_ptr, kvh, T, W,
                                    G, HQ, stride_qt, stride_qh, stride_dot, stride_doh, qk_scale, offs_r, offs_d,
                                    offs_dv, D, DV, G_P, False, HAS_WINDOW, DOT_PREC, TMA)
        for a in range(s2, q_end, BLOCK_T):
            dk, dv = _dkdv_tile(dk, dv, k, v, j, a, q_src, do_src, lse_ptr, delta_ptr, doc_start_ptr, kvh, T, W, G, HQ,
                                stride_qt, stride_qh, stride_dot, stride_doh, qk_scale, offs_r, offs_d, offs_dv,
                                D, DV, G_P, True, HAS_WINDOW, DOT_PREC, TMA)
    dk = dk * scale
    tl.store(dk_ptr + j[:, None] * stride_dkt + kvh * stride_dkh + offs_d[None, :],
             dk.to(dk_ptr.dtype.element_ty), mask=jmask[:, None] & (offs_d[None, :] < D))
    tl.store(dv_ptr + j[:, None] * stride_dvt + kvh * stride_dvh + offs_dv[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=jmask[:, None] & (offs_dv[None, :] < DV))
