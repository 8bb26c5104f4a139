"""Per-token log-probs and entropy straight from the last hidden states and the lm_head weight.

Why: at GPT-OSS width (V = 201088) the logits of a 16k-token micro-batch are 6.6 GB in bf16, 13 GB once
upcast, and their gradient as much again. This op never holds [T, V]: it walks [token chunk, vocab chunk]
tiles of ``z = h @ W^T (+ b)``, computes each tile's logits with one matmul in the inputs' dtype (the same
product as ``lm_head(h)``), upcasts the tile to fp32 and folds it into per-token running statistics. Forward
keeps only per-token lse and entropy for backward; backward recomputes each tile and turns it into its share
of dH and dW at once. Peak extra memory: one fp32 tile (+ dH in fp32, [T, H], and one [vocab chunk, H] fp32
block of dW), never [T, V].

Per token, with x = z/τ over the whole vocabulary (online log-sum-exp over vocab chunks):
- m = max x, s = Σ e^{x−m}, u = Σ e^{x−m}·(x−m)   (a new chunk with a larger max rescales s and u)
- lse = m + log s, log p(label) = x[label] − lse, H = log s − u/s   (H = lse − Σ p·x, without cancellation)
Backward, per tile (p = e^{x − lse}):
- ∂/∂x of g_lp·log p(label) + g_H·H  =  g_lp·(onehot − p) − g_H·p·(log p + H);  ∂/∂z = that / τ
- dH += ∂z @ W[chunk],  dW[chunk] += ∂z^T @ h,  db[chunk] += Σ_rows ∂z.

This is the exact reference (any device, pure torch); the cuda backend runs a Triton forward with the matmul
fused into the statistics (polyrl.backends.cuda.linear_logprobs) and reuses :func:`linear_backward`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from polyrl.core.algorithms.logprobs import check_labels_and_knobs

# Automatic vocabulary chunk: VOCAB_CHUNK columns, fewer when a [chunk_size, ·] fp32 tile would pass
# TILE_ELEMENTS (256 MiB). Backward also keeps one fp32 [vocab chunk, H] block of dW (94 MiB at H = 2880).
TILE_ELEMENTS = 1 << 26
VOCAB_CHUNK = 8192


def _spans(n: int, step: int) -> Iterator[tuple[int, int]]:
    for a in range(0, n, step):
        yield a, min(a + step, n)


def vocab_chunk_for(chunk_size: int, vocab: int, vocab_chunk_size: int | None) -> int:
    """The vocabulary chunk: the caller's, or VOCAB_CHUNK columns (fewer when a [chunk_size, ·] fp32 tile would
    pass TILE_ELEMENTS, never below 1024; the whole vocabulary when it is smaller)."""
    if vocab_chunk_size is not None:
        return max(1, min(vocab_chunk_size, vocab))
    return min(vocab, VOCAB_CHUNK, max(1024, TILE_ELEMENTS // max(1, chunk_size)))


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 math for every input dtype; fp64 inputs keep fp64 (numerical gradient checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tile_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, tau: float) -> torch.Tensor:
    """x = (h @ w^T + b) / τ as a fresh fp32 [c, v] tile; the product is taken in the inputs' dtype, like
    ``lm_head(h)``."""
    z = torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t())
    acc = stats_dtype(z.dtype)
    x = z.to(acc) if z.dtype != acc else z
    if tau != 1.0:
        x.div_(tau)  # z is a fresh tensor: dividing in place is safe
    return x


def linear_forward_stats(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, *,
    chunk_size: int, vocab_chunk_size: int | None, temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse), fp32 [N], of hidden [N, H], weight [V, H], bias [V] | None, labels [N]."""
    N, V = hidden.shape[0], weight.shape[0]
    vc = vocab_chunk_for(chunk_size, V, vocab_chunk_size)
    dev, acc = hidden.device, stats_dtype(hidden.dtype)
    logp = torch.empty(N, dtype=acc, device=dev)
    ent = torch.empty_like(logp)
    lse = torch.empty_like(logp)
    for t0, t1 in _spans(N, chunk_size):
        h, lab = hidden[t0:t1], labels[t0:t1]
        m = s = u = None
        picked = torch.zeros(t1 - t0, dtype=acc, device=dev)
        for v0, v1 in _spans(V, vc):
            x = _tile_logits(h, weight[v0:v1], None if bias is None else bias[v0:v1], temperature)  # (c, v)
            inside = (lab >= v0) & (lab < v1)
            picked += torch.where(inside, x.gather(1, (lab - v0).clamp(0, v1 - v0 - 1)[:, None])[:, 0], 0.0)
            m_tile = x.amax(1)
            if m is None:
                m_new = m_tile
            else:
                m_new = torch.maximum(m, m_tile)
                scale = torch.exp(m - m_new)
                u = scale * (u + (m - m_new) * s)
                s = scale * s
            x.sub_(m_new[:, None])  # y = x − m_new ≤ 0
            e = torch.exp(x)
            s_tile, u_tile = e.sum(1), (e * x).sum(1)
            s, u = (s_tile, u_tile) if s is None else (s + s_tile, u + u_tile)
            m = m_new
            del x, e
        log_s = torch.log(s)
        lse[t0:t1] = m + log_s
        logp[t0:t1] = picked - lse[t0:t1]
        ent[t0:t1] = log_s - u / s
    return logp, ent, lse


def linear_backward(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
    lse: torch.Tensor, ent: torch.Tensor, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, *,
    chunk_size: int, vocab_chunk_size: int | None, temperature: float, needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dhidden, dweight, dbias) by recomputing each [token chunk, vocab chunk] tile of logits.

    Vocabulary chunks outside, token chunks inside: each dW block is summed over the tokens in one fp32
    [vc, H] buffer and written once (no rounding of a bf16 dW across chunks); dH is summed over vocabulary
    chunks in one fp32 [N, H] buffer. ``g_lp`` / ``g_ent`` are fp32 [N] or None (that output unused).
    """
    N, H = hidden.shape
    V = weight.shape[0]
    vc = vocab_chunk_for(chunk_size, V, vocab_chunk_size)
    tau = temperature
    need_h, need_w, need_b = needs
    cdt = hidden.dtype  # the matmuls run in the inputs' dtype, as the unfused lm_head's backward does
    acc = stats_dtype(cdt)
    dh = torch.zeros(N, H, dtype=acc, device=hidden.device) if need_h else None
    dw = torch.empty_like(weight) if need_w else None
    db = torch.empty_like(bias) if need_b and bias is not None else None
    for v0, v1 in _spans(V, vc):
        w = weight[v0:v1]
        b = None if bias is None else bias[v0:v1]
        dw_blk = torch.zeros(v1 - v0, H, dtype=acc, device=hidden.device) if need_w else None
        db_blk = torch.zeros(v1 - v0, dtype=acc, device=hidden.device) if db is not None else None
        for t0, t1 in _spans(N, chunk_size):
            h = hidden[t0:t1]
            x = _tile_logits(h, w, b, tau)  # (c, v) fp32
            x.sub_(lse[t0:t1, None])  # log p
            p = torch.exp(x)
            if g_ent is not None:  # −g_H·p·(log p + H) (+ −g_lp·p below)
                x.add_(ent[t0:t1, None]).mul_(g_ent[t0:t1, None])
                if g_lp is not None:
                    x.add_(g_lp[t0:t1, None])
            else:
                x.copy_(g_lp[t0:t1, None].expand_as(x))
            x.mul_(p).neg_()
            del p
            if g_lp is not None:
                lab = labels[t0:t1]
                inside = (lab >= v0) & (lab < v1)
                rows = inside.nonzero()[:, 0]
                x.index_put_((rows, lab[rows] - v0), g_lp[t0:t1][rows], accumulate=True)
            if tau != 1.0:
                x.div_(tau)  # ∂/∂z, fp32
            gz = x.to(cdt) if cdt != acc else x
            if dh is not None:
                dh[t0:t1] += torch.mm(gz, w).to(acc)
            if dw_blk is not None:
                dw_blk += torch.mm(gz.t(), h).to(acc)
            if db_blk is not None:
                db_blk += x.sum(0)
            del x, gz
        if dw is not None:
            dw[v0:v1] = dw_blk
        if db is not None:
            db[v0:v1] = db_blk
    return (None if dh is None else dh.to(hidden.dtype)), dw, db


class _LinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, hidden: torch.Tensor, weight: torch.Tensor,
        bias: torch.Tensor | None, labels: torch.Tensor, chunk_size: int, vocab_chunk_size: int | None,
        temperature: float, want_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logp, ent, lse = linear_forward_stats(hidden, weight, bias, labels, chunk_size=chunk_size,
                                              vocab_chunk_size=vocab_chunk_size, temperature=temperature)
        if not want_entropy:
            ent = torch.zeros_like(ent)
        return _finish_forward(ctx, hidden, weight, bias, labels, logp, ent, lse, chunk_size, vocab_chunk_size,
                               temperature, want_entropy)

    @staticmethod
    def backward(ctx, g_lp, g_ent):  # type: ignore[override]
        return (*backward_from_ctx(ctx, g_lp, g_ent), None, None, None, None, None)


def _finish_forward(ctx, hidden, weight, bias, labels, logp, ent, lse, chunk_size, vocab_chunk_size, temperature,
                    want_entropy):
    """Save what backward needs (per-token stats only) and mark the outputs; shared with the Triton forward."""
    ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
    ctx.chunk_size, ctx.vocab_chunk_size, ctx.temperature, ctx.want_entropy = (
        chunk_size, vocab_chunk_size, temperature, want_entropy)
    ctx.set_materialize_grads(False)  # an unused output gets None: its term is skipped in backward
    if not want_entropy:
        ctx.mark_non_differentiable(ent)
    return logp, ent


def backward_from_ctx(ctx, g_lp, g_ent) -> tuple:
    """(dhidden, dweight, dbias, None) for a context filled by ``_finish_forward``."""
    hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
    if not ctx.want_entropy:
        g_ent = None
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
    if (g_lp is None and g_ent is None) or not any(needs):
        return None, None, None, None
    dh, dw, db = linear_backward(
        hidden, weight, bias, labels, lse, ent, None if g_lp is None else g_lp.to(lse.dtype),
        None if g_ent is None else g_ent.to(lse.dtype), chunk_size=ctx.chunk_size,
        vocab_chunk_size=ctx.vocab_chunk_size, temperature=ctx.temperature, needs=needs)
    return dh, dw, db, None


def check_linear_inputs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        labels: torch.Tensor, chunk_size: int, vocab_chunk_size: int | None,
                        temperature: float) -> None:
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden [..., H] and weight [V, H] do not match: {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    check_labels_and_knobs(labels, hidden, "hidden", {"chunk_size": chunk_size, "vocab_chunk_size": vocab_chunk_size},
                           temperature)


def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    vocab_chunk_size: int | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax((hidden @ weight^T + bias)/τ)[labels] and the entropy of that softmax, fp32, differentiable
    in hidden, weight and bias, without materialising the [..., T, V] logits.

    Args:
        hidden: [..., T, H] the model's last hidden states (after the final norm), any float dtype.
        weight: [V, H] the lm_head weight (same dtype as hidden); bias: [V] or None.
        labels: [..., T] int64 token ids in [0, V).
        chunk_size: token rows per tile; vocab_chunk_size: vocabulary columns per tile (None: automatic,
            8192, fewer when one fp32 tile would pass 256 MiB).
        temperature: τ (match the sampling temperature). compute_entropy: False returns zeros for it.
    Returns:
        (logp [..., T] fp32, entropy [..., T] fp32); fp64 for fp64 inputs.
    """
    check_linear_inputs(hidden, weight, bias, labels, chunk_size, vocab_chunk_size, temperature)
    shape = labels.shape
    logp, ent = _LinearLogprobEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, labels.reshape(-1).long(), chunk_size,
        vocab_chunk_size, float(temperature), compute_entropy)
    if logp.shape == shape:  # no view: a sharded model's hooks warn on view outputs
        return logp, ent
    return logp.reshape(shape), ent.reshape(shape)
