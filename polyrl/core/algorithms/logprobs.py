"""Per-token log-probabilities and entropy from logits, in fp32, in chunks along the sequence.

Why: with GPT-OSS's 201088-token vocabulary, ``log_softmax(logits.float())`` over a 16k-token sequence
materialises ~13 GB of fp32 (and autograd keeps it for backward). Here a custom autograd function walks
the rows in chunks of ``chunk_size`` and, per chunk, upcasts once into ONE fp32 [chunk, V] work block
that every later step updates in place. Forward keeps only per-row statistics (LSE, entropy) for
backward; backward recomputes the block from the logits, again in place, and writes the gradient
straight into the (logits-dtype) gradient tensor. Peak extra memory is therefore
one fp32 block (+ the gradient of the logits in backward, which any method must return).

In-place identities used (x = logits/τ, y = x − max, s = Σ e^y, lse = max + log s, p = e^{x − lse}):
- log p(label) = y[label] − log s
- H = log s + Σ entr(e^y) / s                        (entr(z) = −z·log z, torch.special.entr)
- ∂ log p(label)/∂x = onehot − p
- ∂H/∂x = −p·(log p + H) = e^{−H}·entr(q) with q = e^{log p + H}   (q ≤ V, so finite in fp32)
The chain rule through x = z/τ adds a factor 1/τ.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _rows3d(logits: torch.Tensor) -> torch.Tensor:
    """A [Bf, T, V] *view* of ``logits`` [..., T, V] whose chunks along T are views.

    A contiguous tensor becomes one long row [1, N, V] (chunks then span sequence boundaries).
    """
    V = logits.shape[-1]
    try:
        return logits.view(1, -1, V)
    except RuntimeError:  # e.g. logits[:, :-1] of a [B, S, V] tensor: iterate per batch row
        return logits.reshape(-1, logits.shape[-2], V) if logits.dim() > 2 else logits.unsqueeze(0)


def _chunks(shape3: torch.Size, chunk: int) -> Iterator[tuple[int, int, int]]:
    for b in range(shape3[0]):
        for t0 in range(0, shape3[1], chunk):
            yield b, t0, min(t0 + chunk, shape3[1])


def _fp32_block(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """A fresh fp32 copy of a [c, V] chunk, divided by τ: the only large temporary."""
    block = x.to(torch.float32, copy=True)
    if temperature != 1.0:
        block.div_(temperature)
    return block


class _ChunkedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        labels: torch.Tensor,
        chunk: int,
        temperature: float,
        want_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x3 = _rows3d(logits)
        lab3 = labels.reshape(x3.shape[:2])
        lse = torch.empty(x3.shape[:2], dtype=torch.float32, device=logits.device)
        logp = torch.empty_like(lse)
        ent = torch.zeros_like(lse)
        for b, t0, t1 in _chunks(x3.shape, chunk):
            block = _fp32_block(x3[b, t0:t1], temperature)  # (c, V) fp32
            row_max = block.amax(-1, keepdim=True)
            block.sub_(row_max)  # y
            picked = block.gather(1, lab3[b, t0:t1].unsqueeze(-1)).squeeze(-1)
            block.exp_()  # e^y
            log_s = block.sum(-1).log()
            lse[b, t0:t1] = row_max.squeeze(-1) + log_s
            logp[b, t0:t1] = picked - log_s
            if want_entropy:
                s = log_s.exp()
                torch.special.entr(block, out=block)
                ent[b, t0:t1] = log_s + block.sum(-1) / s
            del block
        ctx.save_for_backward(logits, labels, lse, ent)
        ctx.chunk, ctx.temperature, ctx.want_entropy = chunk, temperature, want_entropy
        # Unused outputs get None (not zeros) in backward, so the cheaper single-output path runs.
        ctx.set_materialize_grads(False)
        if not want_entropy:
            ctx.mark_non_differentiable(ent)
        out_shape = labels.shape
        return logp.reshape(out_shape), ent.reshape(out_shape)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        logits, labels, lse, ent = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        tau, chunk = ctx.temperature, ctx.chunk
        x3 = _rows3d(logits)
        lab3 = labels.reshape(x3.shape[:2])
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        g3 = grad.view(x3.shape)
        gl = None if g_logp is None else g_logp.reshape(x3.shape[:2]).float()
        ge = None if g_ent is None or not ctx.want_entropy else g_ent.reshape(x3.shape[:2]).float()
        if gl is None and ge is None:
            return None, None, None, None, None
        for b, t0, t1 in _chunks(x3.shape, chunk):
            x = x3[b, t0:t1]
            lse_c = lse[b, t0:t1].unsqueeze(-1)
            if ge is None:
                g3[b, t0:t1] = _grad_logp_block(x, lab3[b, t0:t1], lse_c, gl[b, t0:t1], tau)
            elif gl is None:
                g3[b, t0:t1] = _grad_ent_block(x, lse_c, ent[b, t0:t1].unsqueeze(-1), ge[b, t0:t1], tau)
            else:
                # Both: two half-height sub-chunks, each with two work blocks = one full block.
                half = max(1, (t1 - t0 + 1) // 2)
                for s0 in range(t0, t1, half):
                    s1 = min(s0 + half, t1)
                    g3[b, s0:s1] = _grad_both_block(
                        x3[b, s0:s1],
                        lab3[b, s0:s1],
                        lse[b, s0:s1].unsqueeze(-1),
                        ent[b, s0:s1].unsqueeze(-1),
                        gl[b, s0:s1],
                        ge[b, s0:s1],
                        tau,
                    )
        return grad, None, None, None, None


def _grad_logp_block(
    x: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, tau: float
) -> torch.Tensor:
    """g·(onehot − p)/τ for a (c, V) chunk, in one fp32 block."""
    block = _fp32_block(x, tau)
    block.sub_(lse).exp_()  # p
    block.mul_(-g.unsqueeze(-1))
    block.scatter_add_(1, labels.unsqueeze(-1), g.unsqueeze(-1))
    if tau != 1.0:
        block.div_(tau)
    return block


def _grad_ent_block(x: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor, g: torch.Tensor, tau: float) -> torch.Tensor:
    """g·∂H/∂z = g·e^{−H}·entr(q)/τ with q = exp(log p + H), in one fp32 block."""
    block = _fp32_block(x, tau)
    block.sub_(lse - ent).exp_()  # q
    torch.special.entr(block, out=block)
    block.mul_((g.unsqueeze(-1) * torch.exp(-ent)) / tau)
    return block


def _grad_both_block(
    x: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor,
    tau: float,
) -> torch.Tensor:
    """g_lp·(onehot − p)/τ + g_ent·(−p·(log p + H))/τ, with two (c/2, V) fp32 blocks."""
    logp = _fp32_block(x, tau)
    logp.sub_(lse)  # log p
    p = torch.exp(logp)
    # −p·(g_lp + g_ent·(log p + H))
    logp.add_(ent).mul_(g_ent.unsqueeze(-1)).add_(g_lp.unsqueeze(-1)).mul_(p).neg_()
    del p
    logp.scatter_add_(1, labels.unsqueeze(-1), g_lp.unsqueeze(-1))
    if tau != 1.0:
        logp.div_(tau)
    return logp


def check_labels_and_knobs(labels: torch.Tensor | None, scores: torch.Tensor, scores_name: str,
                           chunk_sizes: dict[str, int | None], temperature: float) -> None:
    """The checks shared by the logits path and the fused lm_head path: ``labels`` index every row of
    ``scores`` ([..., last dim]), chunk sizes (by argument name) are positive (None: automatic), the
    temperature is positive."""
    if labels is not None and labels.shape != scores.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must match {scores_name}[..., :-1] {tuple(scores.shape[:-1])}")
    for name, size in chunk_sizes.items():
        if size is not None and size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _check(logits: torch.Tensor, labels: torch.Tensor | None, chunk_size: int, temperature: float) -> None:
    if logits.dim() < 2:
        raise ValueError(f"logits must be [..., T, V], got shape {tuple(logits.shape)}")
    check_labels_and_knobs(labels, logits, "logits", {"chunk_size": chunk_size}, temperature)


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``labels`` and entropy of softmax(logits/τ), fp32, chunked, differentiable.

    Args:
        logits: [..., T, V] any float dtype (bf16 typical), ideally contiguous. labels: [..., T] int64.
        chunk_size: rows per fp32 work block (memory ≈ chunk_size·V·4 bytes).
        temperature: τ; logits are divided by it (match the sampling temperature).
        compute_entropy: when False the entropy is returned as zeros and its cost is skipped.
    Returns:
        (logp [..., T] fp32, entropy [..., T] fp32).
    """
    _check(logits, labels, chunk_size, temperature)
    return _ChunkedLogprobEntropy.apply(logits, labels.long(), chunk_size, float(temperature), compute_entropy)


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, *, chunk_size: int = 1024, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits/τ)[labels] in fp32, chunked along the sequence. Shapes: [..., T, V], [..., T] -> [..., T]."""
    logp, _ = logprobs_and_entropy(
        logits, labels, chunk_size=chunk_size, temperature=temperature, compute_entropy=False
    )
    return logp


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024, *, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits/τ) per position in fp32, chunked. Shape: [..., T, V] -> [..., T]."""
    _check(logits, None, chunk_size, temperature)
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    _, ent = _ChunkedLogprobEntropy.apply(logits, labels, chunk_size, float(temperature), True)
    return ent
