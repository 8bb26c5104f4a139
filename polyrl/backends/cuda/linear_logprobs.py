"""``triton_linear_logprobs``: the cuda backend's fused lm_head + log-prob + entropy (contract:
polyrl.core.algorithms.linear_logprobs.linear_logprobs_and_entropy).

Forward: one Triton kernel (kernels/linear_logprobs.py) computes the logits tile by tile in fp32 registers and
keeps only per-token statistics (per vocabulary slice), merged here into lse, log p(label) and entropy; the
logits never reach memory, and the forward's extra memory is four fp32 numbers per token and slice.
Backward: NOT a Triton kernel yet — it is the core reference's chunked backward (torch matmuls, cuBLAS), which
recomputes each [token chunk, vocab chunk] tile of logits from the saved per-token lse/entropy and turns it into
its share of dH and dW at once; it never holds [T, V] either (peak: one fp32 tile and one fp32 dW block).
A fused Triton backward (logit tile → ∂z → dH, dW in one kernel, as Cut Cross-Entropy does) is the next step.

The kernel accumulates each logit in fp32 without rounding it to the inputs' dtype (``lm_head(h)`` rounds
it to bf16): it is more accurate than the logits path, not bit-identical to it.
"""

from __future__ import annotations

import torch
import triton

from polyrl.backends.cuda.kernels.configs import interpreting
from polyrl.backends.cuda.kernels.linear_logprobs import linear_lse_fwd_kernel
from polyrl.core.algorithms.linear_logprobs import (
    _finish_forward,
    backward_from_ctx,
    check_linear_inputs,
)


def _blocks() -> dict[str, int]:
    if interpreting():
        return {"BLOCK_T": 16, "BLOCK_V": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
    # Hopper: a 128x128 fp32 accumulator per program (8 warps), K steps of 64 bf16 columns.
    return {"BLOCK_T": 128, "BLOCK_V": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def _splits(n_token_blocks: int, n_vocab_blocks: int) -> int:
    """Vocabulary slices per token tile: enough programs to fill the GPU (~4 waves of 132 SMs) when T is short."""
    target = 16 if interpreting() else 4 * 132
    return max(1, min(n_vocab_blocks, triton.cdiv(target, n_token_blocks)))


def linear_forward_stats_triton(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse) fp32 [N] of hidden [N, H], weight [V, H], bias [V] | None, labels [N]."""
    N, H = hidden.shape
    V = weight.shape[0]
    cfg = _blocks()
    bt, bv = cfg["BLOCK_T"], cfg["BLOCK_V"]
    n_t, n_v = triton.cdiv(N, bt), triton.cdiv(V, bv)
    nsplit = _splits(n_t, n_v)
    cols_per_split = triton.cdiv(n_v, nsplit) * bv
    nsplit = triton.cdiv(V, cols_per_split)  # no empty slice
    stats = torch.empty(4, nsplit, N, dtype=torch.float32, device=hidden.device)
    m, s, u, picked = stats.unbind(0)
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    linear_lse_fwd_kernel[(n_t, nsplit)](
        hidden, weight, bias if bias is not None else weight, labels, m, s, u, picked,
        N, V, H, cols_per_split,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        1.0 / temperature,
        HAS_BIAS=bias is not None, BLOCK_T=bt, BLOCK_V=bv, BLOCK_K=cfg["BLOCK_K"], DOT_PRECISION=precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    # Merge the slices (tiny [nsplit, N] tensors): rescale each slice's sums to the global max M.
    M = m.amax(0)
    scale = torch.exp(m - M)
    S = (scale * s).sum(0)
    U = (scale * (u + (m - M) * s)).sum(0)
    log_s = torch.log(S)
    lse = M + log_s
    return picked.sum(0) - lse, log_s - U / S, lse


class _TritonLinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, vocab_chunk_size, temperature, want_entropy):
        logp, ent, lse = linear_forward_stats_triton(hidden, weight, bias, labels, temperature)
        if not want_entropy:
            ent = torch.zeros_like(ent)
        return _finish_forward(ctx, hidden, weight, bias, labels, logp, ent, lse, chunk_size, vocab_chunk_size,
                               temperature, want_entropy)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        return backward_from_ctx(ctx, g_lp, g_ent) + (None, None, None, None, None)


def triton_linear_logprobs(
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
    """Same contract as linear_logprobs_and_entropy; ``chunk_size`` / ``vocab_chunk_size`` shape the backward's
    recompute tiles (the forward needs no chunking: it never stores a logit)."""
    check_linear_inputs(hidden, weight, bias, labels, chunk_size, vocab_chunk_size, temperature)
    shape = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    logp, ent = _TritonLinearLogprobEntropy.apply(
        h, weight, bias, labels.reshape(-1).long().contiguous(), chunk_size, vocab_chunk_size, float(temperature),
        compute_entropy)
    return logp.reshape(shape), ent.reshape(shape)
