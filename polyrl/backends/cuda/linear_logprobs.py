"""``triton_linear_logprobs``: the cuda backend's fused lm_head + log-prob + entropy (contract:
polyrl.core.algorithms.linear_logprobs.linear_logprobs_and_entropy).

Forward: one Triton kernel (kernels/linear_logprobs.py) computes the logits tile by tile in fp32 registers and
keeps only per-token statistics (per vocabulary slice), merged here into lse, log p(label) and entropy; the
logits never reach memory, and the forward's extra memory is four fp32 numbers per token and slice.
Backward, per vocabulary chunk of VC columns: a Triton kernel recomputes the chunk's logits (matmul in fp32
registers) and writes their gradient ∂z [T, VC] once, in the inputs' dtype; two cuBLAS matmuls turn it into
dW[chunk] = ∂z^T @ h (all tokens at once: one rounding, no accumulation across chunks) and dH += ∂z @ W[chunk]
(summed over chunks in fp32 [T, H]). Peak extra memory: ∂z of one chunk (≤ 128 MiB: VC = 4096 columns at 16k
tokens) + dH in fp32 + the gradients themselves. Not fused further (a CCE-style kernel that also does the two
matmuls needs atomics or a [V, H] fp32 buffer); the torch-only reference backward stays in core.

The kernels accumulate each logit in fp32 without rounding it to the inputs' dtype (``lm_head(h)`` rounds it to
bf16): more accurate than the logits path, not bit-identical to it. float64 inputs run the core reference.
"""

from __future__ import annotations

import torch
import triton

from polyrl.backends.cuda.kernels.configs import interpreting
from polyrl.backends.cuda.kernels.linear_logprobs import linear_grad_logits_kernel, linear_lse_fwd_kernel
from polyrl.core.algorithms.linear_logprobs import (
    _finish_forward,
    check_linear_inputs,
    linear_logprobs_and_entropy,
)

GZ_BYTES = 128 * 2**20  # the backward's ∂z buffer of one vocabulary chunk


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


def _grad_chunk(N: int, V: int, itemsize: int, block_v: int, vocab_chunk_size: int | None) -> int:
    if vocab_chunk_size is not None:
        return max(1, min(vocab_chunk_size, V))
    vc = max(block_v, GZ_BYTES // (max(1, N) * itemsize) // block_v * block_v)
    return min(V, vc)


def linear_backward_triton(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
    lse: torch.Tensor, ent: torch.Tensor, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, *,
    vocab_chunk_size: int | None, temperature: float, needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dhidden, dweight, dbias): per vocabulary chunk, ∂z from the Triton kernel, then dW and dH by cuBLAS."""
    N, H = hidden.shape
    V = weight.shape[0]
    cfg = _blocks()
    bt, bv = cfg["BLOCK_T"], cfg["BLOCK_V"]
    vc = _grad_chunk(N, V, hidden.element_size(), bv, vocab_chunk_size)
    need_h, need_w, need_b = needs
    dh = torch.zeros(N, H, dtype=torch.float32, device=hidden.device) if need_h else None
    dw = torch.empty_like(weight) if need_w else None
    db = torch.empty_like(bias) if need_b and bias is not None else None
    gz = torch.empty(N, vc, dtype=hidden.dtype, device=hidden.device)
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    for v0 in range(0, V, vc):
        n = min(vc, V - v0)
        g = gz[:, :n]
        linear_grad_logits_kernel[(triton.cdiv(N, bt), triton.cdiv(n, bv))](
            hidden, weight, bias if bias is not None else weight, labels, lse, ent,
            g_lp if g_lp is not None else lse, g_ent if g_ent is not None else lse, g,
            N, n, H, v0,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), g.stride(0),
            1.0 / temperature,
            HAS_BIAS=bias is not None, HAS_GLP=g_lp is not None, HAS_GENT=g_ent is not None,
            BLOCK_T=bt, BLOCK_V=bv, BLOCK_K=cfg["BLOCK_K"], DOT_PRECISION=precision,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        if dh is not None:
            dh.add_(torch.mm(g, weight[v0 : v0 + n]))  # [N, H] in the inputs' dtype, summed in fp32
        if dw is not None:
            torch.mm(g.t(), hidden, out=dw[v0 : v0 + n])
        if db is not None:
            db[v0 : v0 + n] = g.sum(0, dtype=torch.float32)
    return (None if dh is None else dh.to(hidden.dtype)), dw, db


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
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        if not ctx.want_entropy:
            g_ent = None
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        if (g_lp is None and g_ent is None) or not any(needs):
            return (None,) * 8
        dh, dw, db = linear_backward_triton(
            hidden, weight, bias, labels, lse, ent,
            None if g_lp is None else g_lp.float().contiguous(), None if g_ent is None else g_ent.float().contiguous(),
            vocab_chunk_size=ctx.vocab_chunk_size, temperature=ctx.temperature, needs=needs)
        return dh, dw, db, None, None, None, None, None


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
    """Same contract as linear_logprobs_and_entropy. The forward needs no chunking (it never stores a logit);
    ``vocab_chunk_size`` sets the backward's ∂z chunk (None: ≤ 128 MiB); ``chunk_size`` is accepted for the
    contract and used only by the float64 fallback."""
    check_linear_inputs(hidden, weight, bias, labels, chunk_size, vocab_chunk_size, temperature)
    if hidden.dtype == torch.float64:  # no fp64 tensor-core dot: the exact reference
        return linear_logprobs_and_entropy(hidden, weight, labels, bias=bias, chunk_size=chunk_size,
                                           vocab_chunk_size=vocab_chunk_size, temperature=temperature,
                                           compute_entropy=compute_entropy)
    shape = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    logp, ent = _TritonLinearLogprobEntropy.apply(
        h, weight, bias, labels.reshape(-1).long().contiguous(), chunk_size, vocab_chunk_size, float(temperature),
        compute_entropy)
    if logp.shape == shape:  # no view: a sharded model's hooks warn on view outputs
        return logp, ent
    return logp.reshape(shape), ent.reshape(shape)
