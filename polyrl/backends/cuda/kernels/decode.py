"""Decode kernel: the generation form of polyrl.core.attention.decode_attention — the last Sq queries of each row
against its KV cache, with key padding mask, sliding window, sinks and GQA. Forward only (the hf engine generates
under ``torch.no_grad()``; polyrl.backends.cuda.decode falls back to the differentiable reference otherwise).

Program = (b * Sq + i, kv head ``kvh``): query i of row b, the G = Hq / Hkv query heads of ``kvh`` together as the
rows of one [G_P, BLOCK_D] q tile. G_P is G rounded up to a power of two and to at least 16, because ``tl.dot``
needs 16 rows (GPT-OSS: G = 8 -> 16, half the rows idle; the kernel is bound by reading the cache, not by the
dot). Rows g >= G load zeros, their sink is 0, and they are never stored. Each [BLOCK_N, BLOCK_D] K tile and
[BLOCK_N, BLOCK_DV] V tile of ``kvh`` is read once for the whole group: K/V are never repeated per query head.

Positions count cache slots (padding included). Query i sits at slot ``p = Sk - Sq + i`` (bottom-right aligned) and
sees key j iff ``j <= p``, ``p - j < W`` (HAS_WINDOW) and ``mask[b, j]`` (HAS_MASK). The key loop covers only
``[max(0, p - W + 1), p + 1)``; its last (partial) tile and the padding mask are masked per key.

Online softmax in fp32, log2 units (``qk_scale`` = scale * log2 e): with sinks, the running max starts at the
sink (``m = s_h log2 e``) and the running sum at 1, so the sink (unscaled, fp32) joins the denominator only and
``m`` is never -inf; without sinks ``m`` starts at a finite -1e30 and ``l`` at 0. A query that sees no key ends
with acc = 0, so its output is zeros either way (``l`` = 0 is divided as 1).

Head dims need not be powers of two (DeepSeek MLA: D = 192, Dv = 128; the tests use 24 / 40): D and Dv are
separate constexprs padded to BLOCK_D / BLOCK_DV (powers of two, at least 16 for ``tl.dot``) with masked loads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from polyrl.backends.cuda.kernels.configs import interpreting

LOG2E = 1.4426950408889634
MIN_DOT = 16  # tl.dot needs every dimension >= 16


def decode_config(block_d: int, block_dv: int) -> dict[str, int]:
    """BLOCK_N (keys per tile), num_warps, num_stages. Under TRITON_INTERPRET=1: 16-key tiles, so the CPU tests'
    caches of up to 40 slots cross tile edges. On the GPU (not measured yet): 64-key tiles for head dims up to 128
    (a [64, 128] bf16 K tile is 16 KiB), 32 for the 256-padded MLA head (D = 192), keeping K + V tiles of a
    two-stage pipeline well inside shared memory."""
    if interpreting():
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_N": 64 if max(block_d, block_dv) <= 128 else 32, "num_warps": 4, "num_stages": 2}


@triton.jit(do_not_specialize=["SK"])
def decode_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, mask_ptr, sink_ptr,
    SQ, SK, W, G, qk_scale,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_mb, stride_ms,
    D: tl.constexpr, DV: tl.constexpr, G_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SINK: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = (pid // SQ).to(tl.int64)  # row offsets in int64: B x Sk x Hkv x D passes 2^31 at GPT-OSS decode shapes
    i = pid % SQ
    pos = SK - SQ + i  # the query's cache slot

    offs_g = tl.arange(0, G_P)
    g_ok = offs_g < G
    h = kvh * G + offs_g  # query head of each row (transformers' repeat_kv order: h // G = kvh)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q = tl.load(q_ptr + b * stride_qb + i * stride_qs + h[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & (offs_d[None, :] < D), other=0.0)  # [G_P, BLOCK_D]
    if HAS_SINK:
        sink = tl.load(sink_ptr + h, mask=g_ok, other=0.0).to(tl.float32)
        m_i = sink * 1.4426950408889634
        l_i = tl.full([G_P], 1.0, tl.float32)
    else:
        m_i = tl.full([G_P], -1.0e30, tl.float32)
        l_i = tl.zeros([G_P], tl.float32)
    acc = tl.zeros([G_P, BLOCK_DV], tl.float32)

    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    hi = pos + 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(pos - W + 1, 0)
    for start_n in range(lo, hi, BLOCK_N):
        j = start_n + offs_n  # [BLOCK_N] cache slots; j >= lo by construction
        in_range = j < hi
        seen = in_range
        if HAS_MASK:
            real = tl.load(mask_ptr + b * stride_mb + j * stride_ms, mask=in_range, other=0)
            seen = seen & (real != 0)
        k = tl.load(k_base + j[:, None] * stride_ks + offs_d[None, :],
                    mask=in_range[:, None] & (offs_d[None, :] < D), other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_base + j[:, None] * stride_vs + offs_dv[None, :],
                    mask=in_range[:, None] & (offs_dv[None, :] < DV), other=0.0)  # [BLOCK_N, BLOCK_DV]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [G_P, BLOCK_N], log2 units
        s = tl.where(seen[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l = 0: no key and no sink, acc = 0 -> zeros
    tl.store(o_ptr + b * stride_ob + i * stride_os + h[:, None] * stride_oh + offs_dv[None, :],
             out.to(o_ptr.dtype.element_ty), mask=g_ok[:, None] & (offs_dv[None, :] < DV))
