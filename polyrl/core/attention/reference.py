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
take the tiled path. Where each document goes (the groups, their gather and scatter indices, masks) is planned once
per batch (``_short_plan``) and shared by every layer's forward and backward; rows are read with ``index_select``
straight from q, k, v as laid out (transformers hands them over head-major) and the forward keeps the gathered
q (scaled), k and v of the short documents for the backward (about the size of q, k, v in fp32, padding
included) instead of gathering them again.
"""

from __future__ import annotations

import bisect
import itertools

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
    docs = sorted((b - a, i) for i, (a, b) in enumerate(itertools.pairwise(cu)) if 0 < b - a <= SHORT_DOC)
    groups, lens, cur, cur_len = [], [], [], 0
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


def _row_view(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """x [T, H, E] as a 2-D view [T * H, E] of its rows without a copy where its strides allow, and whether the
    rows run token-major (row t * H + h; False: head-major, row h * T + t, as transformers' [H, T, E] layout
    transposed gives). A layout that is neither is copied (token-major)."""
    t, h, e = x.shape
    s0, s1, s2 = x.stride()
    if s2 == 1 or e == 1:
        rs = s1 if h > 1 else (s0 if t > 1 else e)  # token-major: rows (t, h) one stride apart
        if rs >= e and (h == 1 or s1 == rs) and (t == 1 or s0 == h * rs):
            return x.as_strided((t * h, e), (rs, 1)), True
        rs = s0 if t > 1 else (s1 if h > 1 else e)  # head-major
        if rs >= e and (t == 1 or s0 == rs) and (h == 1 or s1 == t * rs):
            return x.as_strided((t * h, e), (rs, 1)), False
    return x.reshape(t * h, e), True


class _Group:
    """One padded group of short documents: tok [n, L] the token of each (document, position) (padding
    positions point at the document's first token), valid [n, L], and base, the group's first slot in the
    concatenation of every group's n x L slots."""

    __slots__ = ("_memo", "base", "length", "n", "tok", "valid")

    def __init__(self, tok: torch.Tensor, valid: torch.Tensor, base: int) -> None:
        self.tok, self.valid, self.base = tok, valid, base
        self.n, self.length = tok.shape
        self._memo: dict = {}

    def gather_index(self, h: int, t: int, token_major: bool, heads_inner: bool) -> torch.Tensor:
        """Rows of a [T * H, E] row view (``_row_view``) in the padded order [n, L, H] (``heads_inner``) or
        [n, H, L]."""
        key = ("gather", h, t, token_major, heads_inner)
        if key not in self._memo:
            heads = torch.arange(h, device=self.tok.device)
            heads, tok = (heads[None, None, :], self.tok[:, :, None]) if heads_inner else (heads[None, :, None],
                                                                                          self.tok[:, None, :])
            self._memo[key] = (tok * h + heads if token_major else heads * t + tok).reshape(-1)
        return self._memo[key]

    def blocked(self, window: int | None) -> torch.Tensor:
        """Forbidden (query, key) pairs per document [n, 1, 1, L, L]: not causal, padding keys, outside the window."""
        key = ("blocked", window)
        if key not in self._memo:
            length = self.length
            i = torch.arange(length, device=self.tok.device)[:, None]
            j = torch.arange(length, device=self.tok.device)[None, :]
            allowed = (j <= i)[None] & self.valid[:, None, :]
            if window is not None:
                allowed = allowed & (i - j < window)[None]
            # A padding row sees the first key too, so that every row's LSE' is finite (a window can leave a
            # padding row no key at all); padding rows are never scattered and carry no gradient.
            allowed |= (~self.valid)[:, :, None] & (j == 0)[None]
            self._memo[key] = ~allowed[:, None, None]
        return self._memo[key]

    def real_rows(self, h: int, hkv: int) -> torch.Tensor:
        """1.0 on real rows, 0.0 on padding rows, as [n, Hkv, (H / Hkv) * L, 1] fp32."""
        key = ("rows", h, hkv)
        if key not in self._memo:
            n, length = self.tok.shape
            rows = self.valid[:, None, :].expand(n, h, length).reshape(n, hkv, (h // hkv) * length, 1)
            self._memo[key] = rows.float()
        return self._memo[key]


class _ShortPlan:
    """Where the documents of one ``cu_seqlens`` go: the long ones' tokens and cu_seqlens (``_long_docs``), the
    short ones' padded groups, the packed tokens those cover (``tokens``: None when they are all of them) and,
    per head count H, ``scatter_index(H)``: for each of those tokens (token-major, heads inner) its row in the
    concatenation of the groups' [n, H, L] padded rows. Built once per batch and shared by every layer's forward
    and backward (``_short_plan``)."""

    def __init__(self, cu: list[int], hq: int, device) -> None:
        self.long_index, self.long_cu = _long_docs(cu, device)
        self.groups: list[_Group] = []
        self.tokens = None
        self._memo: dict = {}
        self.device = device
        if self.long_index is None:  # every document long: no dense part
            return
        docs, lens = _short_groups(cu, hq)
        starts = torch.tensor(cu[:-1], dtype=torch.long)
        doc_len = torch.diff(torch.tensor(cu, dtype=torch.long))
        ndocs = len(cu) - 1
        short = torch.zeros(ndocs, dtype=torch.bool)
        doc_base = torch.zeros(ndocs, dtype=torch.long)  # per short document: its group's first slot,
        doc_slot = torch.zeros(ndocs, dtype=torch.long)  # its index in the group, and the group's length
        doc_glen = torch.ones(ndocs, dtype=torch.long)
        base = 0
        for d, length in zip(docs, lens):
            j = torch.arange(length)[None, :]
            valid = j < doc_len[d][:, None]
            tok = starts[d][:, None] + torch.where(valid, j, torch.zeros_like(j))
            self.groups.append(_Group(tok.to(device), valid.to(device), base))
            short[d] = True
            doc_base[d], doc_slot[d], doc_glen[d] = base, torch.arange(len(d)), length
            base += len(d) * length
        doc_of_tok = torch.repeat_interleave(torch.arange(ndocs), doc_len)
        on_short = short[doc_of_tok]
        tokens = torch.arange(cu[-1])[on_short]
        d = doc_of_tok[tokens]
        self._base, self._slot, self._len, self._pos = doc_base[d], doc_slot[d], doc_glen[d], tokens - starts[d]
        self.tokens = None if bool(on_short.all()) else tokens.to(device)

    def scatter_index(self, h: int) -> torch.Tensor:
        if h not in self._memo:
            # the row of (token, head) in the [n, H, L] rows of its group: H * base + (slot * H + head) * L + pos
            heads = torch.arange(h)[None, :]
            rows = (h * self._base[:, None] + (self._slot[:, None] * h + heads) * self._len[:, None]
                    + self._pos[:, None])
            self._memo[h] = rows.reshape(-1).to(self.device)
        return self._memo[h]


_PLANS: dict = {}
_PLANS_KEPT = 8  # plans of the most recent batches (one per micro-batch; a step reuses each several times)


def _short_plan(cu: list[int], hq: int, device) -> _ShortPlan:
    key = (tuple(cu), hq, str(device), SHORT_DOC, SHORT_GROUP_SCORES)
    plan = _PLANS.pop(key, None)
    if plan is None:
        plan = _ShortPlan(cu, hq, device)
    _PLANS[key] = plan  # most recent last
    while len(_PLANS) > _PLANS_KEPT:
        _PLANS.pop(next(iter(_PLANS)))
    return plan


def _gather(x: torch.Tensor, group: _Group, hkv: int) -> torch.Tensor:
    """x [T, H, E] rows of ``group`` -> [n, Hkv, (H / Hkv) * L, E] fp32 (``_heads_major`` per document). With
    one head per KV head (k and v always; q without GQA) the rows are gathered token-major, [n, L, H, E], and
    returned as a permuted view; else contiguous. These are the layouts the matmuls have always been given (their
    rounding depends on it: the same layout, the same numbers)."""
    t, h, e = x.shape
    rows, token_major = _row_view(x)
    n, length = group.n, group.length
    if h == hkv:
        out = rows.index_select(0, group.gather_index(h, t, token_major, True)).float()
        return out.view(n, length, h, e).permute(0, 2, 1, 3)
    out = rows.index_select(0, group.gather_index(h, t, token_major, False)).float()
    return out.view(n, hkv, (h // hkv) * length, e)


def _scatter(parts: list[torch.Tensor], plan: _ShortPlan, h: int, dst: torch.Tensor | None) -> torch.Tensor:
    """Inverse of ``_gather``: the groups' padded rows (each [n, Hkv, (H / Hkv) * L, E]) back to the packed
    [T, H, E] (a new tensor when every document is short, else into ``dst``, short tokens only)."""
    e = parts[0].shape[-1]
    flat = parts[0].reshape(-1, e) if len(parts) == 1 else torch.cat([p.reshape(-1, e) for p in parts])
    rows = flat.index_select(0, plan.scatter_index(h))
    if plan.tokens is None:
        return rows.view(-1, h, e)
    dst.view(-1, h, e).index_copy_(0, plan.tokens, rows.view(-1, h, e).to(dst.dtype))
    return dst


def _dense_scores(qb: torch.Tensor, kb: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """Masked logits [n, Hkv, G * L, L] of qb [n, Hkv, G * L, D] (scaled) against kb [n, Hkv, L, D]."""
    s = torch.matmul(qb, kb.transpose(-1, -2))
    n, hkv, gl, length = s.shape
    s.view(n, hkv, gl // length, length, length).masked_fill_(blocked, float("-inf"))
    return s


def _short_forward(q, k, v, plan, scale, window, sinks, out, lse_out):
    """The short documents' O' and LSE' ([T, Hq, Dv] and [T, Hq]: new tensors when every document is short,
    else written into ``out`` and ``lse_out``) and, per group, what the backward needs: the gathered q (scaled),
    k and v and the padded LSE'."""
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    sink = None if sinks is None else sinks.float().view(1, hkv, g, 1)
    outs, lses, saved = [], [], []
    for group in plan.groups:
        n, length = group.n, group.length
        qb = _gather(q, group, hkv).mul_(scale)  # a fresh tensor: scaled in place
        kb, vb = _gather(k, group, hkv), _gather(v, group, hkv)
        s = _dense_scores(qb, kb, group.blocked(window))
        m = s.amax(dim=-1)  # finite: every row sees at least itself (padding rows see the first token)
        if sink is not None:
            m = torch.maximum(m.view(n, hkv, g, length), sink).view(n, hkv, g * length)
        p = s.sub_(m[..., None]).exp_()
        lse = m + torch.log(p.sum(dim=-1) if sink is None else (p.sum(dim=-1).view(n, hkv, g, length)
                                                                 + torch.exp(sink - m.view(n, hkv, g, length))
                                                                 ).view(n, hkv, g * length))
        outs.append(torch.matmul(p, vb) * torch.exp(m - lse)[..., None])
        lses.append(lse[..., None])
        saved.append((qb, kb, vb, lse[..., None]))
    out = _scatter(outs, plan, hq, out)
    lse_out = _scatter(lses, plan, hq, None if lse_out is None else lse_out[..., None])[..., 0]
    return out, lse_out, saved


def _short_backward(q, k, v, plan, scale, window, saved, delta_all, d_out, need_dq, need_dk, need_dv,
                    dq, dk, dv):
    """The short documents' gradients (each None when not needed; new tensors when every document is short,
    else written into dq [T, Hq, D], dk and dv [T, Hkv, *])."""
    hq, hkv = q.shape[1], k.shape[1]
    dqs, dks, dvs = [], [], []
    for group, (qb, kb, vb, lse) in zip(plan.groups, saved):
        rows = group.real_rows(hq, hkv)
        dob = _gather(d_out, group, hkv).mul_(rows)  # padding rows carry no gradient
        delta = _gather(delta_all[:, :, None], group, hkv).mul_(rows)  # dS = 0 on padding rows
        s = _dense_scores(qb, kb, group.blocked(window))
        p = torch.exp(s.sub_(lse))
        if need_dv:
            dvs.append(torch.matmul(p.transpose(-1, -2), dob))
        ds = p.mul_(torch.matmul(dob, vb.transpose(-1, -2)).sub_(delta))
        if need_dq:
            dqs.append(torch.matmul(ds, kb) * scale)
        if need_dk:
            dks.append(torch.matmul(ds.transpose(-1, -2), qb))
    dq = _scatter(dqs, plan, hq, dq) if need_dq else None
    dk = _scatter(dks, plan, hkv, dk) if need_dk else None
    dv = _scatter(dvs, plan, hkv, dv) if need_dv else None
    return dq, dk, dv


def _long_docs(cu: list[int], device) -> tuple[torch.Tensor | None, list[int]]:
    """The tokens of the documents longer than SHORT_DOC (an index into the packed axis; None when every
    document is long: the whole axis) and their own cu_seqlens."""
    long_ = [(a, b) for a, b in itertools.pairwise(cu) if b - a > SHORT_DOC]
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
        plan = _short_plan(cu, hq, q.device)
        index, sub = plan.long_index, plan.long_cu
        saved = []
        if index is None:  # every document long: the tiled path over the whole axis
            out, lse = _forward(q, k, v, cu, _doc_ids(cu, q.device), scale, window, sinks)
        elif not index.numel() and plan.tokens is None:  # every document short: the dense path alone
            out, lse, saved = _short_forward(q, k, v, plan, scale, window, sinks, None, None)
        else:
            out = torch.empty(t, hq, v.shape[2], dtype=torch.float32, device=q.device)
            lse = torch.empty(t, hq, dtype=torch.float32, device=q.device)
            if index.numel():
                out[index], lse[index] = _forward(q[index], k[index], v[index], sub, _doc_ids(sub, q.device),
                                                  scale, window, sinks)
            if plan.groups:
                out, lse, saved = _short_forward(q, k, v, plan, scale, window, sinks, out, lse)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.cu, ctx.scale, ctx.window, ctx.plan, ctx.short_saved = cu, scale, window, plan, saved
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        need_dq, need_dk, need_dv, need_ds = ctx.needs_input_grad[:4]
        cu, scale, window, plan = ctx.cu, ctx.scale, ctx.window, ctx.plan
        index, sub = plan.long_index, plan.long_cu
        if index is None:
            dq, dk, dv, delta = _backward(q, k, v, cu, _doc_ids(cu, q.device), scale, window, out, lse, d_out,
                                          need_dq, need_dk, need_dv)
        else:
            delta = (d_out.float() * out).sum(dim=-1)  # [T, Hq]
            dq = dk = dv = None
            if index.numel() or plan.tokens is not None:
                dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if need_dq else None
                dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device) if need_dk else None
                dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device) if need_dv else None
            if index.numel():
                parts = _backward(q[index], k[index], v[index], sub, _doc_ids(sub, q.device), scale, window,
                                  out[index], lse[index], d_out[index], need_dq, need_dk, need_dv)
                for whole, part in zip((dq, dk, dv), parts[:3]):
                    if whole is not None:
                        whole[index] = part
            if plan.groups:
                dq, dk, dv = _short_backward(q, k, v, plan, scale, window, ctx.short_saved, delta, d_out,
                                             need_dq, need_dk, need_dv, dq, dk, dv)
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


# --------------------------------------------------------------------------------------------------
# the generation form (decode_attention): queries at the end of a KV cache

DECODE_QUERY_CHUNK = 256  # queries per dense tile in reference_decode_attention: bounds memory at chunk x k_len


def reference_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 dense reference of :func:`polyrl.core.attention.decode_attention` (its contract; the op validates):
    q [B, Sq, Hq, D], k_cache [B, Sk, Hkv, D], v_cache [B, Sk, Hkv, Dv], key_padding_mask None or bool [B, Sk]
    (True = real) -> [B, Sq, Hq, Dv] in q's dtype. Query i sits at key position ``Sk - Sq + i``; a query with no
    visible key returns zeros. Dense over the cache, chunked over queries (``DECODE_QUERY_CHUNK``), GQA without
    repeating K/V, differentiable through ordinary autograd in q, k_cache, v_cache and sinks."""
    b, sq, hq, d = q.shape
    sk, hkv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    if scale is None:
        scale = d**-0.5
    if sq == 0:
        return q.new_zeros(b, 0, hq, dv)
    g = hq // hkv
    kf = k_cache.float().permute(0, 2, 3, 1)  # [B, Hkv, D, Sk]
    vf = v_cache.float().transpose(1, 2)  # [B, Hkv, Sk, Dv]
    kpos = torch.arange(sk, device=q.device)
    valid = None if key_padding_mask is None else key_padding_mask.to(device=q.device, dtype=torch.bool)
    sink = None if sinks is None else sinks.float().view(1, hkv, g, 1)
    outs = []
    for cs in range(0, sq, DECODE_QUERY_CHUNK):
        ce = min(cs + DECODE_QUERY_CHUNK, sq)
        c = ce - cs
        qf = q[:, cs:ce].float().view(b, c, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * c, d)
        s = torch.matmul(qf, kf).mul(scale).view(b, hkv, g, c, sk)
        qpos = torch.arange(sk - sq + cs, sk - sq + ce, device=q.device)[:, None]  # [c, 1]
        allowed = kpos[None, :] <= qpos
        if window is not None:
            allowed = allowed & (qpos - kpos[None, :] < window)
        allowed = allowed[None].expand(b, c, sk)
        if valid is not None:
            allowed = allowed & valid[:, None, :]
        s = s.masked_fill(~allowed[:, None, None], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, c]
        if sink is not None:
            lse = torch.logaddexp(lse, sink)
        lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)  # rows with nothing visible -> 0
        p = torch.exp(s - lse[..., None]).view(b, hkv, g * c, sk)
        o = torch.matmul(p, vf).view(b, hkv, g, c, dv).permute(0, 3, 1, 2, 4).reshape(b, c, hq, dv)
        outs.append(o)
    return torch.cat(outs, dim=1).to(q.dtype)
