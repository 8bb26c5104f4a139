"""The fused lm_head + log-prob + entropy kernels: ``linear_lse_fwd_kernel`` (forward: per-token softmax
statistics of ``(h @ W^T + b) / τ`` with the matmul fused in) and ``linear_grad_logits_kernel`` (backward: the
logit gradient of one vocabulary chunk, recomputed from the per-token lse/entropy, matmul fused in).

Program = (a tile of BLOCK_T tokens, one of NSPLIT slices of the vocabulary). It walks its slice in BLOCK_V
columns; each [BLOCK_T, BLOCK_V] logit tile is accumulated in fp32 registers over H in BLOCK_K steps (tl.dot) and
folded at once into the running per-token statistics (online log-sum-exp), so no logit ever reaches memory:
- m: running max of x = z/τ;  s = Σ e^{x−m};  u = Σ e^{x−m}·(x−m);  picked = x[label] (0 when outside the slice).
Each program writes its four numbers per token to [NSPLIT, N] fp32 buffers; the slices are merged in torch
(polyrl.backends.cuda.linear_logprobs), giving lse, log p(label) and the entropy H = log S − U/S.

The running max starts at a finite −1e30 (not −inf) so that the first rescale is exp(−huge) = 0 times finite
sums, never 0·inf; padded columns (beyond V) and padded rows (beyond N) are masked out of every sum.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def linear_lse_fwd_kernel(
    h_ptr, w_ptr, b_ptr, labels_ptr,  # [N, H], [V, H], [V] (unused when HAS_BIAS is false), [N] int64
    m_ptr, s_ptr, u_ptr, picked_ptr,  # [NSPLIT, N] fp32 each
    N, V, H, cols_per_split,
    stride_hn, stride_hk, stride_wv, stride_wk,
    inv_tau,
    HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    m = tl.full([BLOCK_T], -1e30, dtype=tl.float32)
    s = tl.zeros([BLOCK_T], dtype=tl.float32)
    u = tl.zeros([BLOCK_T], dtype=tl.float32)
    picked = tl.zeros([BLOCK_T], dtype=tl.float32)
    v_start = split * cols_per_split
    v_end = tl.minimum(v_start + cols_per_split, V)
    ks = tl.arange(0, BLOCK_K)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + ks
            k_ok = k < H
            a = tl.load(h_ptr + rows[:, None] * stride_hn + k[None, :] * stride_hk,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + cols[:, None] * stride_wv + k[None, :] * stride_wk,
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc += bias[None, :]
        x = acc * inv_tau
        x = tl.where(col_ok[None, :], x, float("-inf"))
        hit = cols[None, :] == labels[:, None]
        picked += tl.sum(tl.where(hit, x, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        scale = tl.exp(m - m_new)
        u = scale * (u + (m - m_new) * s)
        s = scale * s
        y = tl.where(col_ok[None, :], x - m_new[:, None], 0.0)
        e = tl.where(col_ok[None, :], tl.exp(y), 0.0)
        s += tl.sum(e, axis=1)
        u += tl.sum(e * y, axis=1)
        m = m_new
    out = split * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(u_ptr + out, u, mask=row_ok)
    tl.store(picked_ptr + out, picked, mask=row_ok)


@triton.jit
def linear_grad_logits_kernel(
    h_ptr, w_ptr, b_ptr, labels_ptr,  # [N, H], [V, H] (rows v0.. of the chunk), [V] bias, [N] int64 (global ids)
    lse_ptr, ent_ptr, glp_ptr, gent_ptr,  # [N] fp32 each (glp / gent unused when HAS_GLP / HAS_GENT is false)
    gz_ptr,  # [N, VC] output: ∂loss/∂z of this vocabulary chunk, in the inputs' dtype
    N, VC, H, v0,
    stride_hn, stride_hk, stride_wv, stride_wk, stride_gn,
    inv_tau,
    HAS_BIAS: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Backward's logit gradient for columns [v0, v0 + VC): recompute the tile z = h @ W^T (+ b) in fp32
    registers (as the forward does), then, with x = z/τ, log p = x − lse, p = e^{log p}:
    ∂z = (g_lp·(onehot − p) − g_H·p·(log p + H)) / τ, written once in the inputs' dtype. The two matmuls that
    turn it into dH and dW run in cuBLAS (polyrl.backends.cuda.linear_logprobs)."""
    pid_t = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # within the chunk
    row_ok = rows < N
    col_ok = cols < VC
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + ks
        k_ok = k < H
        a = tl.load(h_ptr + rows[:, None] * stride_hn + k[None, :] * stride_hk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + (v0 + cols)[:, None] * stride_wv + k[None, :] * stride_wk,
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + v0 + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    logp = acc * inv_tau - lse[:, None]
    p = tl.exp(logp)
    coef = tl.zeros([BLOCK_T], dtype=tl.float32)
    if HAS_GLP:
        glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
        coef += glp
    if HAS_GENT:
        gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        g = -p * (coef[:, None] + gent[:, None] * (logp + ent[:, None]))
    else:
        g = -p * coef[:, None]
    if HAS_GLP:
        labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
        g += tl.where((v0 + cols)[None, :] == labels[:, None], glp[:, None], 0.0)
    g = g * inv_tau
    tl.store(gz_ptr + rows[:, None] * stride_gn + cols[None, :], g.to(gz_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
