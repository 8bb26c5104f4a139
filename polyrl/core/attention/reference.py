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

Short documents (at most ``SHORT_DOC`` tokens; RL batches of short prompts and answers) skip the tiles: a tile of
BLOCK_Q rows of 20-token documents computes ~BLOCK_Q / 20 times the scores anyone can see. They are sorted by length
and cut into groups padded to the group's longest, each document a dense [L, L] score block of its own (same
formulas, same fp32 math; at most ``SHORT_GROUP_SCORES`` scores per group). Longer documents of the same batch
take the tiled path.
"""

from __future__ import annotations

import bisect

import torch

BLOCK_Q = 256  # query rows per tile
BLOCK_K = 512  # keys per tile
SHORT_DOC = 128  # documents of at most this many tokens take the dense per-document path (0: none)
SHORT_GROUP_SCORES = 1 << 22  # scores (documents x Hq x L x L) per group of that path: bounds its memory


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


# --- short documents: one dense [L, L] block per document ----------------------------------------------
def _short_groups(cu: list[int], hq: int) -> tuple[list[torch.Tensor], list[int]]:
    """The non-empty documents of at most SHORT_DOC tokens, sorted by length and cut into groups: per group
    the document indices (an int64 tensor) and the group's padded length. Longer documents are not listed."""
    docs = sorted((b - a, i) for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])) if 0 < b - a <= SHORT_DOC)
    groups, lens, cur = [], [], []
    for n, i in docs:  # ascending: the group's padded length is its last (longest) document's
        if cur and (len(cur) + 1) * hq * n * n > SHORT_GROUP_SCORES:
            groups.append(cur)
            lens.append(cur_len)
            cur = []
        cur.append(i)
        cur_len = n
    if cur:
        groups.append(cur)
        lens.append(cur_len)
    return [torch.tensor(g, dtype=torch.long) for g in groups], lens


def _group_index(docs: torch.Tensor, length: int, starts: torch.Tensor, lens: torch.Tensor, device):
    """Token index [n, L] of each document's rows (padding rows point at the document's first token) and the
    valid-row mask [n, L]."""
    j = torch.arange(length, device=device)[None, :]
    st, ln = starts[docs].to(device)[:, None], lens[docs].to(device)[:, None]
    valid = j < ln
    return st + torch.where(valid, j, torch.zeros_like(j)), valid


def _group_mask(valid: torch.Tensor, window: int | None) -> torch.Tensor:
    """Allowed (query, key) pairs per document [n, 1, 1, L, L]: causal, real keys, the window."""
    length = valid.shape[1]
    i = torch.arange(length, device=valid.device)[:, None]
    j = torch.arange(length, device=valid.device)[None, :]
    allowed = (j <= i)[None] & valid[:, None, :]
    if window is not None:
        allowed = allowed & (i - j < window)[None]
    return allowed[:, None, None]


def _dense_gather(x: torch.Tensor, index: torch.Tensor, hkv: int) -> torch.Tensor:
    """x [T, H, E] rows at index [n, L] -> [n, Hkv, (H / Hkv) * L, E] fp32 (``_heads_major`` per document)."""
    n, length = index.shape
    h, e = x.shape[1], x.shape[2]
    g = h // hkv
    return x[index].float().view(n, length, hkv, g, e).permute(0, 2, 3, 1, 4).reshape(n, hkv, g * length, e)


def _dense_scatter(dst: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, x: torch.Tensor) -> None:
    """Inverse of ``_dense_gather`` into dst [T, H, E], valid rows only."""
    n, hkv, gl, e = x.shape
    length = index.shape[1]
    g = gl // length
    rows = x.view(n, hkv, g, length, e).permute(0, 3, 1, 2, 4).reshape(n, length, hkv * g, e)
    dst[index[valid]] = rows[valid].to(dst.dtype)


def _dense_scores(qb: torch.Tensor, kb: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Masked logits [n, Hkv, G * L, L] of qb [n, Hkv, G * L, D] (scaled) against kb [n, Hkv, L, D]."""
    s = torch.matmul(qb, kb.transpose(-1, -2))
    n, hkv, gl, length = s.shape
    s.view(n, hkv, gl // length, length, length).masked_fill_(~allowed, float("-inf"))
    return s


def _short_forward(q, k, v, cu, scale, window, sinks, out, lse_out) -> None:
    """The short documents' O' and LSE' into out [T, Hq, Dv] and lse_out [T, Hq]."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    starts, lens = torch.tensor(cu[:-1]), torch.diff(torch.tensor(cu))
    sink = None if sinks is None else sinks.float().view(1, hkv, g, 1)
    for docs, length in zip(*_short_groups(cu, hq)):
        index, valid = _group_index(docs, length, starts, lens, q.device)
        n = index.shape[0]
        qb = _dense_gather(q, index, hkv) * scale
        kb, vb = _dense_gather(k, index, hkv), _dense_gather(v, index, hkv)
        s = _dense_scores(qb, kb, _group_mask(valid, window))
        m = s.amax(dim=-1)  # finite: every row sees at least itself (padding rows see the first token)
        if sink is not None:
            m = torch.maximum(m.view(n, hkv, g, length), sink).view(n, hkv, g * length)
        p = s.sub_(m[..., None]).exp_()
        lse = m + torch.log(p.sum(dim=-1) if sink is None else (p.sum(dim=-1).view(n, hkv, g, length)
                                                                 + torch.exp(sink - m.view(n, hkv, g, length))
                                                                 ).view(n, hkv, g * length))
        o = torch.matmul(p, vb) * torch.exp(m - lse)[..., None]
        _dense_scatter(out, index, valid, o)
        _dense_scatter(lse_out[..., None], index, valid, lse[..., None])


def _short_backward(q, k, v, cu, scale, window, lse_all, delta_all, d_out, dq, dk, dv) -> None:
    """The short documents' gradients into dq [T, Hq, D], dk and dv [T, Hkv, *] (each None when not needed)."""
    hq, hkv = q.shape[1], k.shape[1]
    starts, lens = torch.tensor(cu[:-1]), torch.diff(torch.tensor(cu))
    for docs, length in zip(*_short_groups(cu, hq)):
        index, valid = _group_index(docs, length, starts, lens, q.device)
        qb = _dense_gather(q, index, hkv) * scale
        kb, vb = _dense_gather(k, index, hkv), _dense_gather(v, index, hkv)
        n, length, g = index.shape[0], index.shape[1], hq // hkv
        rows = valid[:, None, None, :].expand(n, hkv, g, length).reshape(n, hkv, g * length, 1)
        dob = _dense_gather(d_out, index, hkv) * rows  # padding rows carry no gradient
        lse = _dense_gather(lse_all[:, :, None], index, hkv)
        delta = _dense_gather(delta_all[:, :, None], index, hkv) * rows  # dS = 0 on padding rows
        s = _dense_scores(qb, kb, _group_mask(valid, window))
        p = torch.exp(s.sub_(lse))
        if dv is not None:
            _dense_scatter(dv, index, valid, torch.matmul(p.transpose(-1, -2), dob))
        ds = p.mul_(torch.matmul(dob, vb.transpose(-1, -2)).sub_(delta))
        if dq is not None:
            _dense_scatter(dq, index, valid, torch.matmul(ds, kb) * scale)
        if dk is not None:
            _dense_scatter(dk, index, valid, torch.matmul(ds.transpose(-1, -2), qb))


def _long_docs(cu: list[int], device) -> tuple[torch.Tensor | None, list[int]]:
    """The tokens of the documents longer than SHORT_DOC (an index into the packed axis; None when every
    document is long: the whole axis) and their own cu_seqlens."""
    long_ = [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b - a > SHORT_DOC]
    if len(long_) == len(cu) - 1:
        return None, cu
    sub = [0]
    for a, b in long_:
        sub.append(sub[-1] + b - a)
    index = torch.cat([torch.arange(a, b) for a, b in long_]) if long_ else torch.zeros(0, dtype=torch.long)
    return index.to(device), sub


def _doc_ids(cu: list[int], device) -> torch.Tensor:
    lens = torch.diff(torch.tensor(cu, dtype=torch.long))
    return torch.repeat_interleave(torch.arange(len(cu) - 1), lens).to(device)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens, scale, window):
        cu = [int(x) for x in cu_seqlens.tolist()]
        t, hq = q.shape[:2]
        index, sub = _long_docs(cu, q.device)
        if index is None:  # every document long: the tiled path over the whole axis
            out, lse = _forward(q, k, v, cu, _doc_ids(cu, q.device), scale, window, sinks)
        else:
            out = torch.empty(t, hq, v.shape[2], dtype=torch.float32, device=q.device)
            lse = torch.empty(t, hq, dtype=torch.float32, device=q.device)
            if index.numel():
                out[index], lse[index] = _forward(q[index], k[index], v[index], sub, _doc_ids(sub, q.device),
                                                  scale, window, sinks)
            _short_forward(q, k, v, cu, scale, window, sinks, out, lse)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.cu, ctx.scale, ctx.window = cu, scale, window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        need_dq, need_dk, need_dv, need_ds = ctx.needs_input_grad[:4]
        cu, scale, window = ctx.cu, ctx.scale, ctx.window
        index, sub = _long_docs(cu, q.device)
        if index is None:
            dq, dk, dv, delta = _backward(q, k, v, cu, _doc_ids(cu, q.device), scale, window, out, lse, d_out,
                                          need_dq, need_dk, need_dv)
        else:
            delta = (d_out.float() * out).sum(dim=-1)  # [T, Hq]
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if need_dq else None
            dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device) if need_dk else None
            dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device) if need_dv else None
            if index.numel():
                parts = _backward(q[index], k[index], v[index], sub, _doc_ids(sub, q.device), scale, window,
                                  out[index], lse[index], d_out[index], need_dq, need_dk, need_dv)
                for whole, part in zip((dq, dk, dv), parts[:3]):
                    if whole is not None:
                        whole[index] = part
            _short_backward(q, k, v, cu, scale, window, lse, delta, d_out, dq, dk, dv)
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
