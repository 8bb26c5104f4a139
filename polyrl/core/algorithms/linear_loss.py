"""The fused lm_head + log-prob op with the loss's gradient taken inside its forward: three lm_head-sized matmuls
instead of four.

Why: ``linear_logprobs_and_entropy`` (and the cuda backend's kernels of it) returns differentiable log-probs; the
loss is computed from them afterwards, so its gradient reaches the op only in the backward, which must then make the
logits a second time (the forward keeps only per-token statistics). At GPT-OSS width and 16k tokens each
[T, V, H] matmul is ~19 TFLOP: the forward's logits, the backward's recompute, dW and dH are four of them.

The RL losses of the trainer (clipped surrogate, KL penalty, entropy bonus, each aggregated by a fixed linear
weighting of the tokens: polyrl.core.algorithms.aggregation) are sums of per-token terms: the derivative of the loss
with respect to token t's log-prob and entropy depends on that token's values alone. So, per chunk of token rows:
logits → per-token statistics → log-prob and entropy of the chunk → ``token_grad`` (the caller's: d loss / d logp and
d loss / d H of these rows) → ∂z from the *same* logits → dH of the rows, dW and db summed over the chunks. The
backward only scales the gradients kept from the forward by the gradient of the returned anchor.

Contract (``linear_logprob_loss``): hidden [N, H], weight [V, H], bias [V] | None, labels [N];
``token_grad(t0, t1, logp, ent)`` gets the fp32 (fp64 for fp64 inputs) log-probs and entropies [t1 - t0] of the
rows [t0, t1) (detached; ``ent`` is zeros when ``compute_entropy`` is false) and returns ``(g_lp, g_ent)``: [t1 - t0]
tensors or None (that term absent; ``g_ent`` must be None when ``compute_entropy`` is false). It is called once per
chunk, in row order, with autograd on (it may differentiate the caller's loss code). Returns ``(anchor, logp,
ent)``: ``anchor`` a 0-d zero of the hidden's dtype whose gradient g gives hidden, weight and bias the gradients
g · Σ_t (g_lp,t ∂logp_t + g_ent,t ∂H_t); logp and ent fp32 [N], not differentiable. Add the anchor to the loss
whose value is computed from the returned logp / ent.

This module holds the exact reference (pure torch, any device): per chunk it runs the reference forward and
backward of ``linear_logprobs`` (so it recomputes the tiles: its value is the semantics, not the speed), summing dW
and db over chunks in fp32. The cuda backend's ``cublas_linear_logprob_loss`` keeps each chunk's fp32 logits
between the two (polyrl.backends.cuda.linear_logprobs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from polyrl.core.algorithms.linear_logprobs import (
    _spans,
    check_linear_inputs,
    linear_backward,
    linear_forward_stats,
    stats_dtype,
)

# --- what a fused loss op holds: the budgets of the cuda backend's (the dry-run memory plan models the same) -------
# One token chunk's fp32 logits + their ∂z in the inputs' dtype. Each chunk adds its part of dW into the [V, H] sum,
# a read and write of all of dW (2.2 GB at GPT-OSS width in bf16), so fewer, larger chunks are faster: on an H100 at
# 16k tokens the op took 161 ms / 1.46 GiB with 384 MiB (256 rows), 117 ms / 1.89 GiB with 768 MiB (640 rows) and
# 104 ms / 2.62 GiB with 1536 MiB (bench/fused_loss_chunks.py, 2026-12-07; four-matmul path 136 ms, Liger 149).
FUSED_CHUNK_BYTES = 768 * 2**20
DW_FP32_BYTES = 512 * 2**20  # dW summed over token chunks in fp32 up to this size, else in the weight's dtype


def fused_token_chunk(N: int, V: int, itemsize: int, chunk_size: int) -> int:
    """Token rows per chunk of the fused loss: ``chunk_size``, fewer when the chunk's fp32 logits and ∂z would pass
    FUSED_CHUNK_BYTES (then a multiple of 128 rows where possible: 640 at V = 201088 in bf16), never more than N."""
    per_row = max(1, V) * (4 + (itemsize if itemsize != 4 else 0))
    rows = FUSED_CHUNK_BYTES // per_row
    if rows >= 128:
        rows = rows // 128 * 128
    return max(1, min(chunk_size, rows, N))


def dw_accumulator_dtype(weight: torch.Tensor) -> torch.dtype:
    """fp32 where the [V, H] fp32 sum fits DW_FP32_BYTES, else the weight's dtype: at GPT-OSS width (201088 x 2880)
    an fp32 dW would be 2.2 GiB, so it is summed in bf16 there, one rounding per token chunk (as Liger's fused
    linear cross-entropy does)."""
    if weight.dtype == torch.float32 or weight.numel() * 4 <= DW_FP32_BYTES:
        return torch.float32
    return weight.dtype


TokenGrad = Callable[[int, int, torch.Tensor, torch.Tensor], tuple[torch.Tensor | None, torch.Tensor | None]]
# (hidden rows [n, H], their labels [n]) -> (logp, ent, lse) fp32 [n] and what ``ChunkGrads`` needs of the chunk
ChunkStats = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]]
# (rows, labels, state, lse, ent, g_lp, g_ent, dw accumulator | None, db accumulator | None) -> dH of the rows | None
ChunkGrads = Callable[..., torch.Tensor | None]


def fused_loss_forward(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
    token_grad: TokenGrad, *, rows: int, want_entropy: bool, needs: tuple[bool, bool, bool],
    stats: ChunkStats, grads: ChunkGrads, dw_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The chunk loop every implementation shares: (logp, ent, dH, dW, db) of hidden [N, H] in chunks of ``rows``
    token rows, ``stats`` and ``grads`` being the implementation's two halves of a chunk. dW and db are summed over
    the chunks in ``dw_dtype`` (and fp32 / fp64 for db) and returned in the weight's dtype."""
    N, H = hidden.shape
    V = weight.shape[0]
    dev, acc = hidden.device, stats_dtype(hidden.dtype)
    need_h, need_w, need_b = needs
    logp = torch.empty(N, dtype=acc, device=dev)
    ent = torch.zeros(N, dtype=acc, device=dev)
    dh = torch.empty_like(hidden) if need_h else None
    dw = torch.zeros(V, H, dtype=dw_dtype, device=dev) if need_w else None
    db = torch.zeros(V, dtype=acc, device=dev) if need_b and bias is not None else None
    for t0, t1 in _spans(N, rows):
        h, lab = hidden[t0:t1], labels[t0:t1]
        lp_c, ent_c, lse_c, state = stats(h, lab)
        if not want_entropy:
            ent_c = torch.zeros_like(ent_c)
        logp[t0:t1], ent[t0:t1] = lp_c, ent_c
        with torch.enable_grad():
            g_lp, g_ent = token_grad(t0, t1, lp_c, ent_c)
        if g_ent is not None and not want_entropy:
            raise ValueError("token_grad returned an entropy gradient, but compute_entropy is false")
        for name, g in (("g_lp", g_lp), ("g_ent", g_ent)):
            if g is not None and tuple(g.shape) != (t1 - t0,):
                raise ValueError(f"token_grad's {name} must be [{t1 - t0}] for rows [{t0}, {t1}), got {tuple(g.shape)}")
        if not any(needs):  # values only (no input wants a gradient): nothing to make of the logits
            continue
        if g_lp is None and g_ent is None:
            if dh is not None:
                dh[t0:t1] = 0
            continue
        g_lp = None if g_lp is None else g_lp.detach().to(acc).contiguous()
        g_ent = None if g_ent is None else g_ent.detach().to(acc).contiguous()
        dh_c = grads(h, lab, state, lse_c, ent_c, g_lp, g_ent, dw, db)
        if dh is not None:
            dh[t0:t1] = dh_c
        del state
    return (logp, ent, dh, None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype))  # type: ignore[union-attr]


class FusedLossAnchor(torch.autograd.Function):
    """Hands gradients computed in a forward to autograd: forward returns a 0-d zero (the anchor), backward the
    kept gradients of hidden, weight and bias times the anchor's gradient. They are scaled in place (no second
    [V, H] copy of dW: 1.1 GiB at GPT-OSS width), so the graph gives them out once: a second backward through it
    (``retain_graph``) is refused."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, dh, dw, db):  # type: ignore[override]
        ctx.save_for_backward(dh, dw, db)
        ctx.handed_out = False
        return hidden.new_zeros(())

    @staticmethod
    def backward(ctx, g_anchor):  # type: ignore[override]
        if ctx.handed_out:
            raise RuntimeError("the fused loss's gradients were handed out by an earlier backward through this graph "
                               "(retain_graph): run the forward again")
        ctx.handed_out = True
        dh, dw, db = ctx.saved_tensors

        def scaled(grad: torch.Tensor | None, i: int) -> torch.Tensor | None:
            if grad is None or not ctx.needs_input_grad[i]:
                return None
            return grad.mul_(g_anchor.to(grad.dtype))

        return scaled(dh, 0), scaled(dw, 1), scaled(db, 2), None, None, None


def anchored(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dh: torch.Tensor | None,
             dw: torch.Tensor | None, db: torch.Tensor | None, logp: torch.Tensor,
             ent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(anchor, logp, ent): the anchor's gradient wired to hidden, weight and bias (``FusedLossAnchor``); logp and
    ent as they are (computed without autograd: no gradient flows through them)."""
    return FusedLossAnchor.apply(hidden, weight, bias, dh, dw, db), logp, ent


def check_loss_inputs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                      chunk_size: int, vocab_chunk_size: int | None, temperature: float) -> None:
    """``linear_logprobs``' input checks, and rows only: hidden [N, H], labels [N] (ValueError otherwise)."""
    check_linear_inputs(hidden, weight, bias, labels, chunk_size, vocab_chunk_size, temperature)
    if hidden.dim() != 2 or labels.dim() != 1:
        raise ValueError(f"hidden must be [N, H] and labels [N], got {tuple(hidden.shape)}, {tuple(labels.shape)}")


def input_needs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[bool, bool, bool]:
    """Which of hidden, weight, bias want a gradient (autograd on and requires_grad)."""
    on = torch.is_grad_enabled()
    return (on and hidden.requires_grad, on and weight.requires_grad,
            on and bias is not None and bias.requires_grad)


def linear_logprob_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_grad: TokenGrad,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    vocab_chunk_size: int | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact reference of the fused log-prob + loss-gradient op (module docstring): ``(anchor, logp, ent)``.

    Args:
        hidden: [N, H] the selected last hidden states; weight: [V, H]; bias: [V] or None; labels: [N] int64.
        token_grad: ``(t0, t1, logp, ent) -> (g_lp, g_ent)`` per chunk of rows (module docstring).
        chunk_size: token rows per chunk (and per tile); vocab_chunk_size: vocabulary columns per tile.
        temperature: τ; compute_entropy: False gives zero entropies and allows no entropy gradient.
    """
    check_loss_inputs(hidden, weight, bias, labels, chunk_size, vocab_chunk_size, temperature)
    labels = labels.long()
    tau = float(temperature)
    needs = input_needs(hidden, weight, bias)

    def stats(h: torch.Tensor, lab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        logp, ent, lse = linear_forward_stats(h, weight, bias, lab, chunk_size=len(h),
                                              vocab_chunk_size=vocab_chunk_size, temperature=tau)
        return logp, ent, lse, None

    def grads(h, lab, _state, lse, ent, g_lp, g_ent, dw, db):
        need = (needs[0], dw is not None, db is not None)
        dh_c, dw_c, db_c = linear_backward(h, weight, bias, lab, lse, ent, g_lp, g_ent, chunk_size=len(h),
                                           vocab_chunk_size=vocab_chunk_size, temperature=tau, needs=need)
        if dw is not None:
            dw += dw_c
        if db is not None:
            db += db_c
        return dh_c

    with torch.no_grad():
        logp, ent, dh, dw, db = fused_loss_forward(
            hidden.detach(), weight.detach(), None if bias is None else bias.detach(), labels, token_grad,
            rows=chunk_size, want_entropy=compute_entropy, needs=needs, stats=stats, grads=grads,
            dw_dtype=stats_dtype(weight.dtype))
    return anchored(hidden, weight, bias, dh, dw, db, logp, ent)
