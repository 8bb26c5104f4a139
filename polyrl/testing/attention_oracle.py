"""The fp64 dense oracle of varlen attention, for polyrl's tests and for plugin authors.

Written the way transformers' eager GPT-OSS attention is (REFERENCE §1), independently of every kernel and
of polyrl.core.reference_attention: one document at a time, K/V repeated per query head, an explicit
causal / window mask (``q - k < window``), the sink as an extra logit column of the softmax, dropped after.
Quadratic in document length: tiny shapes only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


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
    for a, b in itertools.pairwise(int(x) for x in cu_seqlens):
        if b == a:
            continue
        qd, kd, vd = q[a:b].double(), k[a:b].double(), v[a:b].double()
        kd, vd = kd.repeat_interleave(g, dim=1), vd.repeat_interleave(g, dim=1)
        logits = torch.einsum("ihd,jhd->hij", qd, kd) * scale  # (Hq, L, L)
        i = torch.arange(b - a, device=q.device)[:, None]
        j = torch.arange(b - a, device=q.device)[None, :]
        allowed = j <= i
        if window is not None:
            allowed = allowed & (i - j < window)
        logits = logits.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            logits = torch.cat([logits, sinks.double().view(-1, 1, 1).expand(-1, b - a, 1)], dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]
        outs.append(torch.einsum("hij,jhd->ihd", probs, vd))
    return torch.cat(outs, dim=0)
