"""``triton_linear_logprobs``: the cuda backend's fused lm_head + log-prob + entropy (contract:
polyrl.core.algorithms.linear_logprobs.linear_logprobs_and_entropy). Two implementations, picked per call by
POLYRL_LINEAR_LOGPROBS (``cublas``, the default, or ``triton``; anything else is refused with BadInputError). The
default is ``cublas``: ``python bench/logprob_linear.py`` (which prints both) measured it faster on a GPU at 4k and
16k tokens (H100, 16k tokens with entropy: 141 ms against 199 ms).

``triton`` (:func:`triton_fused_linear_logprobs`). Forward: one Triton kernel (kernels/linear_logprobs.py)
computes the logits tile by tile in fp32 registers and keeps only per-token statistics (per vocabulary slice),
merged here into lse, log p(label) and entropy; the logits never reach memory, and the forward's extra memory is
four fp32 numbers per token and slice.
Backward, per vocabulary chunk of VC columns: a Triton kernel recomputes the chunk's logits (matmul in fp32
registers) and writes their gradient ∂z [T, VC] once, in the inputs' dtype; two cuBLAS matmuls turn it into
dW[chunk] = ∂z^T @ h (all tokens at once: one rounding, no accumulation across chunks) and dH += ∂z @ W[chunk]
(summed over chunks in fp32 [T, H]). Peak extra memory: ∂z of one chunk (≤ 128 MiB: VC = 4096 columns at 16k
tokens) + dH in fp32 + the gradients themselves. Not fused further (a CCE-style kernel that also does the two
matmuls needs atomics or a [V, H] fp32 buffer); the torch-only reference backward stays in core.

``cublas`` (:func:`cublas_linear_logprobs`; its Triton passes in kernels/linear_logprobs_cublas.py). Why a second
path: the Triton path's fused matmuls (forward, and the backward's recompute) likely run well below cuBLAS on
Hopper; here all four [T, V, H] matmuls (forward logits, backward recompute, dW, dH: ~4 x 19 TFLOP at 16k tokens
of GPT-OSS) are cuBLAS calls and Triton only reads their fp32 output (one pass over each fp32 chunk).

Forward, token chunks of Tc rows (outer) x the whole vocabulary: logits z = h_c @ W^T in fp32 [Tc, V]
(cuBLAS with an fp32 output: no rounding to bf16), then one Triton pass over the chunk gives each token's
(max, Σe, Σe·y, picked) per vocabulary slice; one merge at the end gives lse, log p, H. Tc = chunk_size,
fewer when one fp32 chunk would pass LOGITS_BYTES (512 MiB: 640 rows at V = 201088). The forward never holds
more than that one chunk; only per-token lse and H are saved for the backward.

Backward, vocabulary chunks of VC columns (outer) x all T tokens: z = h @ W[chunk]^T in fp32 [T, VC], one
Triton elementwise pass writes ∂z [T, VC] in the inputs' dtype, then dW[chunk] = ∂z^T @ h (K = T: every token
summed inside one cuBLAS call, one rounding to bf16, no accumulator across chunks: an fp32 [V, H] one would
be 2.2 GiB at GPT-OSS width, a bf16 one would round once per token chunk) and dH += ∂z @ W[chunk] (summed
over vocabulary chunks in one fp32 [T, H] buffer, accumulated by cuBLAS itself: beta = 1, fp32 C, no
temporary). The fp32 z and the bf16 ∂z of one chunk (6 bytes per element) stay within GRAD_BYTES (192 MiB:
VC = 2048 at T = 16384). Extra memory at T = 16384, V = 201088, H = 2880, bf16: backward dW 1.08 GiB (the
gradient itself) + dH fp32 0.18 GiB + 0.19 GiB of chunk buffers ≈ 1.45 GiB; forward 0.49 GiB.

Precision: logits in fp32 straight from the tensor cores (like the Triton path, more accurate than
``lm_head(h)`` which rounds them to bf16); ∂z rounded to the inputs' dtype before the two gradient matmuls (as
the Triton path and the core reference do); dW rounded once; dH summed in fp32, rounded once.
fp32-output GEMMs of bf16/fp16 inputs are ``torch.mm(a, b, out_dtype=torch.float32)`` and the fp32 accumulate
``torch.baddbmm(acc, a, b, out_dtype=torch.float32, out=acc)`` (CUDA-only kernels, pytorch PR 150812; torch
2.13's CPU build has the overloads but no CPU kernel). Each is probed once per device and dtype (_fp32_gemms;
tests/cuda/test_linear_logprobs_gpu.py asserts both on the GPU); where missing: the logits are taken in
the inputs' dtype and upcast (rounded to bf16 like lm_head(h) and the core reference; within the same bars),
and dH adds fp32 products of ≤ 32 MiB row blocks. On CPU tensors without TRITON_INTERPRET the two Triton
passes run as torch code (_row_stats_torch, _grad_torch), so the chunking and the matmuls are testable there.

Both paths accumulate each logit in fp32 without rounding it to the inputs' dtype (``lm_head(h)`` rounds it to
bf16): more accurate than the logits path, not bit-identical to it. float64 inputs run the core reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton

from polyrl.backends.cuda.kernels.configs import interpreting
from polyrl.backends.cuda.kernels.linear_logprobs import linear_grad_logits_kernel, linear_lse_fwd_kernel
from polyrl.backends.cuda.kernels.linear_logprobs_cublas import logits_grad_kernel, logits_row_stats_kernel
from polyrl.backends.cuda.linear_logprobs_choice import linear_logprobs_path
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
    return _merge_slices(m, s, u, picked)


def _merge_slices(
    m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, picked: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse) fp32 [N] from per-slice statistics [nsplit, N] (m, s, u, picked of the kernels)."""
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


def _flatten_call(function: type[torch.autograd.Function], hidden: torch.Tensor, weight: torch.Tensor,
                  labels: torch.Tensor, bias: torch.Tensor | None, chunk_size: int, vocab_chunk_size: int | None,
                  temperature: float, compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the inputs, then run one of the autograd Functions on [N, H] rows (float64: the exact core reference,
    no fp64 tensor-core dot); outputs in the labels' shape."""
    check_linear_inputs(hidden, weight, bias, labels, chunk_size, vocab_chunk_size, temperature)
    if hidden.dtype == torch.float64:
        return linear_logprobs_and_entropy(hidden, weight, labels, bias=bias, chunk_size=chunk_size,
                                           vocab_chunk_size=vocab_chunk_size, temperature=temperature,
                                           compute_entropy=compute_entropy)
    shape = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    logp, ent = function.apply(
        h, weight, bias, labels.reshape(-1).long().contiguous(), chunk_size, vocab_chunk_size, float(temperature),
        compute_entropy)
    if logp.shape == shape:  # no view: a sharded model's hooks warn on view outputs
        return logp, ent
    return logp.reshape(shape), ent.reshape(shape)


def triton_fused_linear_logprobs(
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
    """The Triton path (``POLYRL_LINEAR_LOGPROBS=triton``), whatever the variable says. Same contract
    as linear_logprobs_and_entropy. The forward needs no chunking (it never stores a logit); ``vocab_chunk_size``
    sets the backward's ∂z chunk (None: ≤ 128 MiB); ``chunk_size`` is accepted for the contract and used only by
    the float64 fallback."""
    return _flatten_call(_TritonLinearLogprobEntropy, hidden, weight, labels, bias, chunk_size, vocab_chunk_size,
                         temperature, compute_entropy)


# --- the cuBLAS path (POLYRL_LINEAR_LOGPROBS=cublas; design and choices: the module docstring) -------------
LOGITS_BYTES = 512 * 2**20  # the forward's fp32 [Tc, V] logits chunk
GRAD_BYTES = 192 * 2**20  # the backward's fp32 z + ∂z of one [T, VC] vocabulary chunk
ACC_TEMP_BYTES = 32 * 2**20  # the fallback dH accumulation's fp32 product block


def _runs_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or interpreting()


@functools.cache
def _fp32_gemms(device: torch.device, dtype: torch.dtype) -> tuple[bool, bool]:
    """(fp32-output mm, fp32 accumulating batched mm) of ``dtype`` inputs work on ``device``: probed once on a
    2x2 product with exact integer results, so a torch without the kernels (or one that ignored beta) falls back
    instead of failing or summing wrong."""
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=dtype, device=device)
    want = torch.tensor([[7.0, 10.0], [15.0, 22.0]])
    try:
        mm_ok = torch.equal(torch.mm(a, a, out_dtype=torch.float32).cpu(), want)
    except (RuntimeError, TypeError, NotImplementedError):
        mm_ok = False
    try:
        acc = torch.ones(1, 2, 2, dtype=torch.float32, device=device)
        torch.baddbmm(acc, a[None], a[None], out_dtype=torch.float32, out=acc)
        acc_ok = torch.equal(acc[0].cpu(), want + 1)
    except (RuntimeError, TypeError, NotImplementedError):
        acc_ok = False
    return mm_ok, acc_ok


def _mm_fp32_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out [M, N] fp32 = a [M, K] @ b [K, N] (inputs' dtype), without rounding the product to the inputs' dtype
    where the device has the fp32-output GEMM."""
    if a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    elif _fp32_gemms(a.device, a.dtype)[0]:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:  # rounded to the inputs' dtype first, as lm_head(h) and the core reference do
        out.copy_(torch.mm(a, b))


def _mm_accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc [M, N] fp32 += a [M, K] @ b [K, N] (inputs' dtype), summed in fp32."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    mm_ok, acc_ok = _fp32_gemms(a.device, a.dtype)
    if acc_ok:  # cuBLAS beta = 1 on the fp32 C: no temporary, no rounding of the partial product
        acc3 = acc[None]  # [1, M, N]; the same object as self and out, so no copy of self into out
        torch.baddbmm(acc3, a[None], b[None], out_dtype=torch.float32, out=acc3)
        return
    rows = max(1, ACC_TEMP_BYTES // (4 * max(1, acc.shape[1])))
    for r0 in range(0, acc.shape[0], rows):
        part = a[r0 : r0 + rows]
        acc[r0 : r0 + rows] += torch.mm(part, b, out_dtype=torch.float32) if mm_ok else torch.mm(part, b)


def token_chunk(N: int, V: int, chunk_size: int) -> int:
    """The forward's token rows per chunk: ``chunk_size``, fewer when one fp32 [rows, V] chunk would pass
    LOGITS_BYTES (then a multiple of 128 rows when that is possible), never more than N."""
    rows = LOGITS_BYTES // (4 * max(1, V))
    if rows >= 128:
        rows = rows // 128 * 128
    return max(1, min(chunk_size, rows, N))


def grad_vocab_chunk(N: int, V: int, itemsize: int, vocab_chunk_size: int | None) -> int:
    """The backward's vocabulary columns per chunk: ``vocab_chunk_size``, else as many multiples of 128 as keep the
    fp32 z and the ∂z of one [N, VC] chunk within GRAD_BYTES (∂z overwrites z in place for fp32 inputs)."""
    if vocab_chunk_size is not None:
        return max(1, min(vocab_chunk_size, V))
    per_elem = 4 + (itemsize if itemsize != 4 else 0)
    vc = GRAD_BYTES // (max(1, N) * per_elem) // 128 * 128
    return min(V, max(128, vc))


def _stats_config() -> dict[str, int]:
    if interpreting():
        return {"BLOCK_T": 4, "BLOCK_V": 16, "num_warps": 4, "num_stages": 1, "target": 16}
    # A memory-bound pass: 4 rows x 1024 columns per step (32 fp32 per thread of 4 warps), the next step's load
    # in flight; programs for ~4 waves of 132 SMs. Not tuned (no GPU measurement yet).
    return {"BLOCK_T": 4, "BLOCK_V": 1024, "num_warps": 4, "num_stages": 2, "target": 4 * 132}


def _grad_config() -> dict[str, int]:
    if interpreting():
        return {"BLOCK_T": 8, "BLOCK_V": 16, "num_warps": 4}
    return {"BLOCK_T": 16, "BLOCK_V": 256, "num_warps": 4}  # elementwise: 4096 elements per program


def _row_stats_torch(z: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, inv_tau: float,
                     out: tuple[torch.Tensor, ...]) -> None:
    """What logits_row_stats_kernel computes, as one slice, in torch (CPU tensors without the interpreter)."""
    x = z if bias is None else z + bias.float()
    x = x * inv_tau
    m = x.amax(1)
    y = x - m[:, None]
    e = torch.exp(y)
    for dst, val in zip(out, (m, e.sum(1), (e * y).sum(1), x.gather(1, labels[:, None])[:, 0])):
        dst.copy_(val)


def _grad_torch(z: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, lse: torch.Tensor,
                ent: torch.Tensor, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, v0: int, inv_tau: float,
                out: torch.Tensor) -> None:
    """What logits_grad_kernel computes, in torch (CPU tensors without the interpreter)."""
    n = z.shape[1]
    x = z if bias is None else z + bias[v0 : v0 + n].float()
    logp = x * inv_tau - lse[:, None]
    p = torch.exp(logp)
    coef = g_lp if g_lp is not None else torch.zeros_like(lse)
    g = -p * (coef[:, None] + g_ent[:, None] * (logp + ent[:, None])) if g_ent is not None else -p * coef[:, None]
    if g_lp is not None:
        inside = (labels >= v0) & (labels < v0 + n)
        rows = inside.nonzero()[:, 0]
        g[rows, labels[rows] - v0] += g_lp[rows]
    out.copy_(g * inv_tau)


def linear_forward_stats_cublas(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, temperature: float,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse) fp32 [N] of hidden [N, H], weight [V, H], bias [V] | None, labels [N]: per token chunk
    one cuBLAS matmul into fp32 logits [Tc, V] and one Triton pass over them (module comment above)."""
    N = hidden.shape[0]
    V = weight.shape[0]
    tc = token_chunk(N, V, chunk_size)
    inv_tau = 1.0 / temperature
    triton_ok = _runs_triton(hidden)
    if triton_ok:
        cfg = _stats_config()
        bt, bv = cfg["BLOCK_T"], cfg["BLOCK_V"]
        n_v = triton.cdiv(V, bv)
        nsplit = max(1, min(n_v, triton.cdiv(cfg["target"], triton.cdiv(tc, bt))))
        cols_per_split = triton.cdiv(n_v, nsplit) * bv
        nsplit = triton.cdiv(V, cols_per_split)  # no empty slice
    else:
        nsplit = 1
    stats = torch.empty(4, nsplit, N, dtype=torch.float32, device=hidden.device)
    m, s, u, picked = stats.unbind(0)
    buf = torch.empty(tc * V, dtype=torch.float32, device=hidden.device)  # one chunk's logits, reused
    wt = weight.t()  # [H, V] view: cuBLAS reads W transposed, no copy
    for t0 in range(0, N, tc):
        n = min(tc, N - t0)
        z = buf[: n * V].view(n, V)
        _mm_fp32_into(z, hidden[t0 : t0 + n], wt)
        if triton_ok:
            logits_row_stats_kernel[(triton.cdiv(n, bt), nsplit)](
                z, bias if bias is not None else z, labels[t0 : t0 + n], m, s, u, picked,
                n, V, N, t0, cols_per_split, z.stride(0), inv_tau,
                HAS_BIAS=bias is not None, BLOCK_T=bt, BLOCK_V=bv, num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"],
            )
        else:
            _row_stats_torch(z, bias, labels[t0 : t0 + n], inv_tau,
                             (m[0, t0 : t0 + n], s[0, t0 : t0 + n], u[0, t0 : t0 + n], picked[0, t0 : t0 + n]))
        del z
    del buf
    return _merge_slices(m, s, u, picked)


def linear_backward_cublas(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
    lse: torch.Tensor, ent: torch.Tensor, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, *,
    vocab_chunk_size: int | None, temperature: float, needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dhidden, dweight, dbias): per vocabulary chunk, cuBLAS logits (fp32), the Triton ∂z pass, cuBLAS dW and
    dH (module comment above). ``g_lp`` / ``g_ent``: fp32 [N] or None (that output unused: its term skipped)."""
    N, H = hidden.shape
    V = weight.shape[0]
    dev, cdt = hidden.device, hidden.dtype
    vc = grad_vocab_chunk(N, V, hidden.element_size(), vocab_chunk_size)
    inv_tau = 1.0 / temperature
    need_h, need_w, need_b = needs
    dh = torch.zeros(N, H, dtype=torch.float32, device=dev) if need_h else None
    dw = torch.empty_like(weight) if need_w else None
    db = torch.empty_like(bias) if need_b and bias is not None else None
    zbuf = torch.empty(N * vc, dtype=torch.float32, device=dev)
    gbuf = zbuf if cdt == torch.float32 else torch.empty(N * vc, dtype=cdt, device=dev)  # fp32: ∂z over z
    triton_ok = _runs_triton(hidden)
    cfg = _grad_config()
    bt, bv = cfg["BLOCK_T"], cfg["BLOCK_V"]
    for v0 in range(0, V, vc):
        n = min(vc, V - v0)
        z = zbuf[: N * n].view(N, n)  # contiguous [N, n]: cuBLAS writes it directly
        g = gbuf[: N * n].view(N, n)
        w = weight[v0 : v0 + n]  # [n, H]
        _mm_fp32_into(z, hidden, w.t())
        if triton_ok:
            logits_grad_kernel[(triton.cdiv(N, bt), triton.cdiv(n, bv))](
                z, bias if bias is not None else z, labels, lse, ent,
                g_lp if g_lp is not None else lse, g_ent if g_ent is not None else lse, g,
                N, n, v0, z.stride(0), g.stride(0), inv_tau,
                HAS_BIAS=bias is not None, HAS_GLP=g_lp is not None, HAS_GENT=g_ent is not None,
                BLOCK_T=bt, BLOCK_V=bv, num_warps=cfg["num_warps"], num_stages=1,
            )
        else:
            _grad_torch(z, bias, labels, lse, ent, g_lp, g_ent, v0, inv_tau, g)
        if dh is not None:
            _mm_accumulate(dh, g, w)  # [N, n] @ [n, H], summed in fp32
        if dw is not None:
            torch.mm(g.t(), hidden, out=dw[v0 : v0 + n])  # [n, N] @ [N, H]: all tokens in one call, one rounding
        if db is not None:
            db[v0 : v0 + n] = g.sum(0, dtype=torch.float32)
        del z, g
    del zbuf, gbuf  # before dH's cast: the chunk buffers are not part of the end's peak
    return (None if dh is None else dh.to(cdt)), dw, db


class _CublasLinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, vocab_chunk_size, temperature, want_entropy):
        logp, ent, lse = linear_forward_stats_cublas(hidden, weight, bias, labels, temperature, chunk_size)
        if not want_entropy:
            ent = torch.zeros_like(ent)
        return _finish_forward(ctx, hidden, weight, bias, labels, logp, ent, lse, chunk_size, vocab_chunk_size,
                               temperature, want_entropy)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        if not ctx.want_entropy:
            g_ent = None  # compute_entropy=False: the entropy term is skipped (HAS_GENT=False)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        if (g_lp is None and g_ent is None) or not any(needs):
            return (None,) * 8
        dh, dw, db = linear_backward_cublas(
            hidden, weight, bias, labels, lse, ent,
            None if g_lp is None else g_lp.float().contiguous(), None if g_ent is None else g_ent.float().contiguous(),
            vocab_chunk_size=ctx.vocab_chunk_size, temperature=ctx.temperature, needs=needs)
        return dh, dw, db, None, None, None, None, None


def cublas_linear_logprobs(
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
    """The cuBLAS path (``POLYRL_LINEAR_LOGPROBS=cublas``, the default), whatever the variable says. Same contract as
    linear_logprobs_and_entropy. ``chunk_size``: the forward's token rows per fp32 logits chunk (fewer when one
    chunk would pass 512 MiB); ``vocab_chunk_size``: the backward's vocabulary columns per chunk (None: the fp32
    logits and ∂z of one chunk within 192 MiB). Its GPU speed is not measured yet (bench/logprob_linear.py)."""
    return _flatten_call(_CublasLinearLogprobEntropy, hidden, weight, labels, bias, chunk_size, vocab_chunk_size,
                         temperature, compute_entropy)


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
    """The cuda backend's ``linear_logprobs`` kernel (its name is the one polyrl.backends.cuda registers). Same
    contract as linear_logprobs_and_entropy. POLYRL_LINEAR_LOGPROBS, read on every call, picks the path:
    ``cublas`` (default: :func:`cublas_linear_logprobs`) or ``triton`` (:func:`triton_fused_linear_logprobs`);
    any other value is refused (BadInputError)."""
    fn = cublas_linear_logprobs if linear_logprobs_path() == "cublas" else triton_fused_linear_logprobs
    return fn(hidden, weight, labels, bias=bias, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size,
              temperature=temperature, compute_entropy=compute_entropy)


# --- the loss's gradient in the forward (polyrl.core.algorithms.linear_loss): three matmuls, not four ---------
# Its chunk rows and dW dtype: polyrl.core.algorithms.linear_loss.fused_token_chunk / dw_accumulator_dtype (core,
# so that the dry-run memory plan reads the same rule).


def cublas_linear_logprob_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_grad: Callable[..., Any],
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    vocab_chunk_size: int | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cuda backend's fused log-prob + loss gradient (contract: polyrl.core.algorithms.linear_loss): per token
    chunk of Tc rows, z = h_c @ W^T in fp32 [Tc, V] (cuBLAS), one Triton pass for the rows' statistics, the
    caller's ``token_grad`` on the rows' log-probs, one Triton pass writing ∂z [Tc, V] in the inputs' dtype from the
    same z, then dH_c = ∂z @ W (one cuBLAS call over the whole vocabulary: one rounding), dW += ∂z^T @ h_c and
    db += Σ ∂z. Three [Tc, V, H] matmuls per chunk where ``cublas_linear_logprobs`` and its backward make four.

    Memory: the chunk's z and ∂z (≤ linear_loss.FUSED_CHUNK_BYTES), dH [N, H] in the inputs' dtype, dW
    (``linear_loss.dw_accumulator_dtype``) and db, all kept from the forward to the backward. ``vocab_chunk_size``
    is accepted for the contract (the float64 reference uses it). float64 inputs run the core reference."""
    from polyrl.core.algorithms.linear_loss import (
        anchored,
        check_loss_inputs,
        dw_accumulator_dtype,
        fused_loss_forward,
        fused_token_chunk,
        input_needs,
        linear_logprob_loss,
    )

    check_loss_inputs(hidden, weight, bias, labels, chunk_size, vocab_chunk_size, temperature)
    if hidden.dtype == torch.float64:
        return linear_logprob_loss(hidden, weight, labels, token_grad, bias=bias, chunk_size=chunk_size,
                                   vocab_chunk_size=vocab_chunk_size, temperature=temperature,
                                   compute_entropy=compute_entropy)
    needs = input_needs(hidden, weight, bias)
    h_all, w, b = hidden.detach(), weight.detach(), None if bias is None else bias.detach()
    w = w if w.stride(-1) == 1 else w.contiguous()
    lab_all = labels.reshape(-1).long().contiguous()
    N, V = h_all.shape[0], w.shape[0]
    cdt = h_all.dtype
    tc = fused_token_chunk(N, V, h_all.element_size(), chunk_size)
    inv_tau = 1.0 / float(temperature)
    triton_ok = _runs_triton(h_all)
    zbuf = torch.empty(tc * V, dtype=torch.float32, device=h_all.device)
    gbuf = zbuf if cdt == torch.float32 else torch.empty(tc * V, dtype=cdt, device=h_all.device)
    scfg, gcfg = _stats_config(), _grad_config()
    wt = w.t()

    def stats(h: torch.Tensor, lab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        z = zbuf[: n * V].view(n, V)
        _mm_fp32_into(z, h, wt)
        if triton_ok:
            bt, bv = scfg["BLOCK_T"], scfg["BLOCK_V"]
            n_v = triton.cdiv(V, bv)
            nsplit = max(1, min(n_v, triton.cdiv(scfg["target"], triton.cdiv(n, bt))))
            cols_per_split = triton.cdiv(n_v, nsplit) * bv
            nsplit = triton.cdiv(V, cols_per_split)
            st = torch.empty(4, nsplit, n, dtype=torch.float32, device=h.device)
            m, s, u, picked = st.unbind(0)
            logits_row_stats_kernel[(triton.cdiv(n, bt), nsplit)](
                z, b if b is not None else z, lab, m, s, u, picked, n, V, n, 0, cols_per_split, z.stride(0), inv_tau,
                HAS_BIAS=b is not None, BLOCK_T=bt, BLOCK_V=bv, num_warps=scfg["num_warps"],
                num_stages=scfg["num_stages"],
            )
        else:
            st = torch.empty(4, 1, n, dtype=torch.float32, device=h.device)
            m, s, u, picked = st.unbind(0)
            _row_stats_torch(z, b, lab, inv_tau, (m[0], s[0], u[0], picked[0]))
        logp, ent, lse = _merge_slices(m, s, u, picked)
        return logp, ent, lse, z

    def grads(h, lab, z, lse, ent, g_lp, g_ent, dw, db):
        n = h.shape[0]
        g = gbuf[: n * V].view(n, V)  # for fp32 inputs ∂z overwrites z, element by element
        if triton_ok:
            bt, bv = gcfg["BLOCK_T"], gcfg["BLOCK_V"]
            logits_grad_kernel[(triton.cdiv(n, bt), triton.cdiv(V, bv))](
                z, b if b is not None else z, lab, lse, ent, g_lp if g_lp is not None else lse,
                g_ent if g_ent is not None else lse, g, n, V, 0, z.stride(0), g.stride(0), inv_tau,
                HAS_BIAS=b is not None, HAS_GLP=g_lp is not None, HAS_GENT=g_ent is not None,
                BLOCK_T=bt, BLOCK_V=bv, num_warps=gcfg["num_warps"], num_stages=1,
            )
        else:
            _grad_torch(z, b, lab, lse, ent, g_lp, g_ent, 0, inv_tau, g)
        if dw is not None:
            if dw.dtype == cdt:
                dw.addmm_(g.t(), h)  # [V, n] @ [n, H] added in the weight's dtype: one rounding per chunk
            else:
                _mm_accumulate(dw, g.t(), h)  # summed in fp32
        if db is not None:
            db += g.sum(0, dtype=torch.float32)
        return torch.mm(g, w) if needs[0] else None  # [n, H]: all V summed inside one cuBLAS call

    with torch.no_grad():
        logp, ent, dh, dw, db = fused_loss_forward(
            h_all, w, b, lab_all, token_grad, rows=tc, want_entropy=compute_entropy, needs=needs, stats=stats,
            grads=grads, dw_dtype=dw_accumulator_dtype(w))
    return anchored(hidden, weight, bias, dh, dw, db, logp, ent)
