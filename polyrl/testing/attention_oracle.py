"""The fp64 dense oracle of varlen attention, for polyrl's tests and for plugin authors.

Written the way transformers' eager GPT-OSS attention is (docs/background.md §1), independently of every kernel and
of polyrl.core.attention.reference: one document at a time, K/V repeated per query head, an explicit
causal / window mask (``q - k < window``), the sink as an extra logit column of the softmax, dropped after.
Quadratic in document length: tiny shapes only (documents of a few hundred tokens are fine).

Gradients come from autograd through :func:`dense_attention_fp64`. :func:`gradient_floors_fp64` gives, for
each row of dQ and dK, the size of the term that cancels where the exact gradient is near zero: the scale
against which a correct low-precision backward's rounding has to be measured there.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def _doc_probs(qd, kd, *, scale, window, sinks) -> torch.Tensor:
    """Softmax probabilities [Hq, L, L] of one document (fp64, K already repeated per query head)."""
    n = qd.shape[0]
    logits = torch.einsum("ihd,jhd->hij", qd, kd) * scale  # (Hq, L, L)
    i = torch.arange(n, device=qd.device)[:, None]
    j = torch.arange(n, device=qd.device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.double().view(-1, 1, 1).expand(-1, n, 1)], dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)
    return probs[..., :n] if sinks is not None else probs


def _documents(cu_seqlens: torch.Tensor | Sequence[int]):
    for a, b in itertools.pairwise(int(x) for x in cu_seqlens):
        if b > a:
            yield a, b


def dense_attention_fp64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    *,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """[T, Hq, Dv] fp64 output (differentiable) of packed causal attention with optional window and sinks."""
    g = q.shape[1] // k.shape[1]
    outs = []
    for a, b in _documents(cu_seqlens):
        qd, kd, vd = q[a:b].double(), k[a:b].double(), v[a:b].double()
        kd, vd = kd.repeat_interleave(g, dim=1), vd.repeat_interleave(g, dim=1)
        probs = _doc_probs(qd, kd, scale=scale, window=window, sinks=sinks)
        outs.append(torch.einsum("hij,jhd->ihd", probs, vd))
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[2], dtype=torch.float64)
    return torch.cat(outs, dim=0)


@torch.no_grad()
def gradient_floors_fp64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    d_out: torch.Tensor,
    *,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row error scales of dQ [T, Hq] and dK [T, Hkv] that no correct flash-style backward can beat (fp64).

    dQ_i = scale sum_j P_ij (dP_ij - D_i) k_j with D_i = dO_i . O_i. Where dP_ij and D_i nearly cancel (a
    one-key window: dQ = dK = 0 exactly; a sink that takes almost nothing: dQ ~ 1 - P_ii), the exact
    gradient is near zero while any kernel that reads D_i from its output rounded to the input dtype (as
    FlashAttention does) carries an error of u * A_i, A_i = sum_d |dO_id O_id|, through that term. The scale
    of that term is A_i * ||sum_j P_ij k_j|| for dQ_i and ||(A_i P_ij q_i)_i|| (independent errors) summed
    over the query heads of key j for dK_j; both times ``scale``.
    """
    t, hq, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    fq = torch.zeros(t, hq, dtype=torch.float64)
    fk = torch.zeros(t, hkv, dtype=torch.float64)
    for a, b in _documents(cu_seqlens):
        qd, kd, vd, dod = (x[a:b].double().cpu() for x in (q, k, v, d_out))
        kd, vd = kd.repeat_interleave(g, dim=1), vd.repeat_interleave(g, dim=1)
        p = _doc_probs(qd, kd, scale=scale, window=window, sinks=None if sinks is None else sinks.cpu())
        o = torch.einsum("hij,jhd->ihd", p, vd)
        size_d = (dod * o).abs().sum(-1)  # A_i: [L, Hq]
        kbar = torch.einsum("hij,jhd->ihd", p, kd)  # [L, Hq, D]
        fq[a:b] = scale * size_d * kbar.norm(dim=-1)
        terms = (p * size_d.T[..., None]).pow(2)  # (A_i P_ij)^2: [Hq, L, L]
        fk[a:b] = scale * torch.einsum("hij,ih->jh", terms, qd.pow(2).sum(-1)).view(b - a, hkv, g).sum(-1).sqrt()
    return fq, fk
