"""The exact reference of ``varlen_attention``: blockwise, online softmax, recomputing backward, fp32 math.

Design choice: the packed token axis is cut into query blocks of ``BLOCK_Q`` rows, and each query block
walks only the key blocks it can see (from the start of its first row's document, or the start of its
window, up to its last row). Documents are separated by a per-tile mask built from document ids, so many
short documents share one tile (cheap for RL batches of short sequences) and one long document costs a
triangle (or a band, with a window) of tiles, never a [T, T] score matrix. Memory is linear in tokens: the
forward keeps only the fp32 output O' and the log-sum-exp LSE' (sink included); the backward recomputes
the scores tile by tile (docs/background.md §1):

    D_i = rowsum(dO'_i * O'_i),  P'_ij = exp(l_ij - LSE'_i),  dS_ij = P'_ij (dO'_i . v_j - D_i)
    dQ = scale dS K,  dK = scale dS^T Q,  dV = P'^T dO',  ds_h = -sum_i exp(s_h - LSE'_i) D_i

GQA is handled by laying the G = Hq / Hkv query heads of one KV head side by side as extra rows of the
score tile ([Hkv, G * rows, keys]), so K and V are never repeated per query head.
Query head h belongs to KV head h // G (the transformers ``repeat_kv`` order).
"""

from __future__ import annotations

import bisect

import torch

BLOCK_Q = 256  # query rows per tile
BLOCK_K = 512  # keys per tile


def _key_range(qs: int, qe: int, cu: list[int], window: int | None) -> tuple[int, int]:
    """The keys any row of the query block [qs, qe) may see: [lo, qe)."""
    doc = bisect.bisect_right(cu, qs) - 1
    lo = cu[doc]
    if window is not None:
        lo = max(lo, qs - window + 1)
    return lo, qe


def _tile_mask(qs: int, qe: int, ks: int, ke: int, doc_ids: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """Allowed (query, key) pairs of a tile as a bool [n, m], or None when every pair is allowed."""
    same_doc = bool(doc_ids[ks] == doc_ids[qe - 1])  # ids are sorted: first key and last query bound all
    if same_doc and ke - 1 <= qs and (window is None or qe - 1 - ks < window):
        return None
    qpos = torch.arange(qs, qe, device=doc_ids.device)[:, None]
    kpos = torch.arange(ks, ke, device=doc_ids.device)[None, :]
    allowed = (doc_ids[qs:qe, None] == doc_ids[None, ks:ke]) & (kpos <= qpos)
    if window is not None:
        allowed &= qpos - kpos < window
    return allowed


def _scores(qb: torch.Tensor, kb: torch.Tensor, mask: torch.Tensor | None, groups: int) -> torch.Tensor:
    """Logits of a tile, masked with -inf: [Hkv, G * n, m]. qb [Hkv, G*n, D] (already scaled), kb [Hkv, m, D]."""
    s = torch.bmm(qb, kb.transpose(1, 2))
    if mask is not None:
        hkv, gn, m = s.shape
        s.view(hkv, groups, gn // groups, m).masked_fill_(~mask, float("-inf"))
    return s


def _heads_major(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[n, Hq, E] -> [Hkv, G * n, E] (fp32 copy), rows of one KV head's G query heads side by side."""
    n, hq, e = x.shape
    g = hq // hkv
    return x.float().view(n, hkv, g, e).permute(1, 2, 0, 3).reshape(hkv, g * n, e)


def _tokens_major(x: torch.Tensor, hq: int) -> torch.Tensor:
    """Inverse of ``_heads_major``: [Hkv, G * n, E] -> [n, Hq, E]."""
    hkv, gn, e = x.shape
    g = hq // hkv
    n = gn // g
    return x.view(hkv, g, n, e).permute(2, 0, 1, 3).reshape(n, hq, e)


def _forward(q, k, v, cu, doc_ids, scale, window, sinks):
    """O' [T, Hq, Dv] fp32 and LSE' [Hkv, G*T] in head-major row order per block (stored as [T, Hq])."""
    t, hq, _ = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    g = hq // hkv
    out = torch.empty(t, hq, dv, dtype=torch.float32, device=q.device)
    lse_out = torch.empty(t, hq, dtype=torch.float32, device=q.device)
    sink = None if sinks is None else sinks.float().view(hkv, g, 1)
    kf = k.float().transpose(0, 1)  # [Hkv, T, D]
    vf = v.float().transpose(0, 1)  # [Hkv, T, Dv]
    for qs in range(0, t, BLOCK_Q):
        qe = min(qs + BLOCK_Q, t)
        n = qe - qs
        qb = _heads_major(q[qs:qe], hkv) * scale  # [Hkv, G*n, D], scale folded into q
        m_i = torch.full((hkv, g * n), float("-inf"), device=q.device)
        l_i = torch.zeros(hkv, g * n, device=q.device)
        acc = torch.zeros(hkv, g * n, dv, device=q.device)
        lo, hi = _key_range(qs, qe, cu, window)
        for ks in range(lo, hi, BLOCK_K):
            ke = min(ks + BLOCK_K, hi)
            s = _scores(qb, kf[:, ks:ke], _tile_mask(qs, qe, ks, ke, doc_ids, window), g)
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            # Rows that have seen no allowed key yet keep m = -inf; shift them by 0 so exp gives 0, not NaN.
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = s.sub_(m_safe[..., None]).exp_()
            alpha = torch.exp(m_i - m_safe)
            l_i = l_i * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.bmm(p, vf[:, ks:ke])
            m_i = m_new
        # Every row sees at least itself, so l_i > 0 and m_i is finite here.
        lse = m_i + torch.log(l_i)
        if sink is not None:
            lse = torch.logaddexp(lse.view(hkv, g, n), sink).view(hkv, g * n)
        o = acc * torch.exp(m_i - lse)[..., None]  # = acc / (l + e^{s - m}) : the sink joins the denominator
        out[qs:qe] = _tokens_major(o, hq)
        lse_out[qs:qe] = _tokens_major(lse[..., None], hq)[..., 0]
    return out, lse_out


def _backward(q, k, v, cu, doc_ids, scale, window, out, lse_all, d_out, need_dq, need_dk, need_dv):
    t, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    g = hq // hkv
    delta_all = (d_out.float() * out).sum(dim=-1)  # [T, Hq]
    dq = torch.zeros(t, hq, d, dtype=torch.float32, device=q.device) if need_dq else None
    dk = torch.zeros(hkv, t, d, dtype=torch.float32, device=q.device)
    dvv = torch.zeros(hkv, t, dv, dtype=torch.float32, device=q.device)
    kf = k.float().transpose(0, 1)
    vf = v.float().transpose(0, 1)
    for qs in range(0, t, BLOCK_Q):
        qe = min(qs + BLOCK_Q, t)
        qb = _heads_major(q[qs:qe], hkv) * scale  # [Hkv, G*n, D], scale folded into q
        dob = _heads_major(d_out[qs:qe], hkv)  # [Hkv, G*n, Dv]
        lse = _heads_major(lse_all[qs:qe, :, None], hkv)  # [Hkv, G*n, 1]
        delta = _heads_major(delta_all[qs:qe, :, None], hkv)
        dqb = torch.zeros_like(qb) if need_dq else None
        lo, hi = _key_range(qs, qe, cu, window)
        for ks in range(lo, hi, BLOCK_K):
            ke = min(ks + BLOCK_K, hi)
            kb, vb = kf[:, ks:ke], vf[:, ks:ke]
            s = _scores(qb, kb, _tile_mask(qs, qe, ks, ke, doc_ids, window), g)
            p = torch.exp(s.sub_(lse))  # P' (masked entries: exp(-inf) = 0)
            if need_dv:
                dvv[:, ks:ke] += torch.bmm(p.transpose(1, 2), dob)
            ds = p.mul_(torch.bmm(dob, vb.transpose(1, 2)).sub_(delta))  # dS, in place of P'
            if need_dq:
                dqb.baddbmm_(ds, kb, alpha=scale)
            if need_dk:
                dk[:, ks:ke].baddbmm_(ds.transpose(1, 2), qb)  # qb carries the scale
        if need_dq:
            dq[qs:qe] = _tokens_major(dqb, hq)
    return dq, dk.transpose(0, 1), dvv.transpose(0, 1), delta_all


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens, scale, window):
        cu = [int(x) for x in cu_seqlens.tolist()]
        doc_ids = torch.repeat_interleave(
            torch.arange(len(cu) - 1, device=q.device), torch.diff(cu_seqlens.to(q.device).long())
        )
        out, lse = _forward(q, k, v, cu, doc_ids, scale, window, sinks)
        ctx.save_for_backward(q, k, v, sinks, doc_ids, out, lse)
        ctx.cu, ctx.scale, ctx.window = cu, scale, window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, sinks, doc_ids, out, lse = ctx.saved_tensors
        need_dq, need_dk, need_dv, need_ds = ctx.needs_input_grad[:4]
        dq, dk, dv, delta = _backward(
            q, k, v, ctx.cu, doc_ids, ctx.scale, ctx.window, out, lse, d_out, need_dq, need_dk, need_dv
        )
        d_sinks = None
        if sinks is not None and need_ds:
            p_sink = torch.exp(sinks.float()[None, :] - lse)  # [T, Hq]: the sink's share of each row
            d_sinks = (-(p_sink * delta).sum(dim=0)).to(sinks.dtype)
        return (
            dq.to(q.dtype) if need_dq else None,
            dk.to(k.dtype) if need_dk else None,
            dv.to(v.dtype) if need_dv else None,
            d_sinks,
            None,
            None,
            None,
        )


def reference_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Exact fp32 packed causal attention (contract and validation in :func:`polyrl.core.attention.varlen_attention`).

    q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv], cu_seqlens [N+1] -> [T, Hq, Dv] in q's dtype.
    Differentiable in q, k, v and sinks; memory O(T) (tiles of BLOCK_Q x BLOCK_K per head).
    """
    if q.shape[0] == 0:
        return q.new_zeros(0, q.shape[1], v.shape[2])
    return _VarlenAttention.apply(q, k, v, sinks, cu_seqlens, float(scale), window)
