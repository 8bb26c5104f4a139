"""The two Triton epilogues of the cuBLAS path of the fused lm_head + log-prob + entropy op
(``cublas_linear_logprobs`` in polyrl.backends.cuda.linear_logprobs): every matmul runs in cuBLAS and writes fp32
logits; these kernels only read them.

- ``logits_row_stats_kernel`` (forward): per-token softmax statistics of x = (z + b)/τ for a chunk of R token
  rows of fp32 logits z [R, V], one read of the chunk. Program = (BLOCK_T rows, one of NSPLIT vocabulary
  slices); it walks its slice in BLOCK_V columns with an online log-sum-exp and writes, per row, the same four
  numbers as the matmul-fused kernel (kernels/linear_logprobs.py): m = max x, s = Σ e^{x−m},
  u = Σ e^{x−m}·(x−m), picked = x[label] (0 outside the slice), into [NSPLIT, N] fp32 buffers at the chunk's
  rows; the host merges the slices once for all N tokens.
- ``logits_grad_kernel`` (backward): elementwise over fp32 logits z [N, VC] of one vocabulary chunk (all tokens):
  ∂loss/∂z = (g_lp·(onehot − p) − g_H·p·(log p + H)) / τ with log p = x − lse (per-token lse and H saved by the
  forward), written once in the output's dtype (the inputs', bf16 on the GPU) for the dW and dH matmuls.

Both run under TRITON_INTERPRET=1 on CPU tensors (fp32/fp16 inputs; the interpreter gets bf16 arithmetic wrong).
The running max starts at a finite −1e30 (not −inf) so the first rescale is exp(−huge)·0, never 0·inf; padded
rows and columns are masked out of every sum.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def logits_row_stats_kernel(
    z_ptr,  # [R, V] fp32 logits of this token chunk, z = h @ W^T (no bias, not divided by τ); row stride stride_zr
    b_ptr,  # [V] bias (unused when HAS_BIAS is false)
    labels_ptr,  # [R] int64 labels of the chunk's rows
    m_ptr, s_ptr, u_ptr, picked_ptr,  # [NSPLIT, N] fp32 each (all N tokens); the chunk starts at token row0
    R, V, N, row0, cols_per_split, stride_zr,
    inv_tau,
    HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < R
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    m = tl.full([BLOCK_T], -1e30, dtype=tl.float32)
    s = tl.zeros([BLOCK_T], dtype=tl.float32)
    u = tl.zeros([BLOCK_T], dtype=tl.float32)
    picked = tl.zeros([BLOCK_T], dtype=tl.float32)
    v_start = split * cols_per_split
    v_end = tl.minimum(v_start + cols_per_split, V)
    row_base = rows.to(tl.int64) * stride_zr  # R·V passes 2^31 at 16k tokens' worth of a 201k vocabulary
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        ok = row_ok[:, None] & col_ok[None, :]
        z = tl.load(z_ptr + row_base[:, None] + cols[None, :], mask=ok, other=0.0)
        if HAS_BIAS:
            z += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        x = tl.where(col_ok[None, :], z * inv_tau, float("-inf"))  # [BLOCK_T, BLOCK_V]
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
    out = split * N + row0 + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(u_ptr + out, u, mask=row_ok)
    tl.store(picked_ptr + out, picked, mask=row_ok)


@triton.jit
def logits_grad_kernel(
    z_ptr,  # [N, VC] fp32 logits of vocabulary columns [v0, v0 + VC), z = h @ W[chunk]^T (no bias, not / τ)
    b_ptr, labels_ptr,  # [V] bias (unused when HAS_BIAS is false), [N] int64 global label ids
    lse_ptr, ent_ptr, glp_ptr, gent_ptr,  # [N] fp32 each (glp / gent unused when HAS_GLP / HAS_GENT is false)
    gz_ptr,  # [N, VC] out: ∂loss/∂z, in the inputs' dtype (may alias z_ptr when that is fp32: same element)
    N, VC, v0, stride_zn, stride_gn,
    inv_tau,
    HAS_BIAS: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # within the chunk
    row_ok = rows < N
    col_ok = cols < VC
    ok = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)  # N·VC may pass 2^31
    z = tl.load(z_ptr + rows64[:, None] * stride_zn + cols[None, :], mask=ok, other=0.0)
    if HAS_BIAS:
        z += tl.load(b_ptr + v0 + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    logp = z * inv_tau - lse[:, None]
    p = tl.exp(logp)
    coef = tl.zeros([BLOCK_T], dtype=tl.float32)
    if HAS_GLP:
        glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
        coef += glp
    if HAS_GENT:  # the entropy's term only when the entropy is in the loss (else its gradient is None)
        gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        g = -p * (coef[:, None] + gent[:, None] * (logp + ent[:, None]))
    else:
        g = -p * coef[:, None]
    if HAS_GLP:
        labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
        g += tl.where((v0 + cols)[None, :] == labels[:, None], glp[:, None], 0.0)
    g = g * inv_tau
    tl.store(gz_ptr + rows64[:, None] * stride_gn + cols[None, :], g.to(gz_ptr.dtype.element_ty), mask=ok)
