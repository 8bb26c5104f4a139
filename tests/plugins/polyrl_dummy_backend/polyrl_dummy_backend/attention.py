"""The dummy backend's attention kernel: pure torch, queries in chunks of 32, written from docs/plugins.md.

Each document is cut into chunks of ``CHUNK`` queries; a chunk attends to the keys of its document it can
see (from the document start, or from its first query's window start, up to its last query), through one
dense fp32 score tile with the causal / window mask, the sink as an extra softmax column. Differentiable
through autograd (a real plugin would write its backward by hand, as polyrl's kernels do). Output in q's
dtype; autograd returns dsinks in the sinks' dtype.
"""

from __future__ import annotations

import itertools

import torch

CHUNK = 32  # queries per tile


def _key_span(doc_start: int, qs: int, qe: int, window: int | None) -> tuple[int, int]:
    """Keys [lo, hi) that some query of the chunk [qs, qe) may see."""
    lo = doc_start if window is None else max(doc_start, qs - window + 1)
    return lo, qe


def _chunk(q, k, v, qs, qe, lo, hi, *, scale, window, sinks):
    """Output [n, Hq, Dv] (fp32) of the queries [qs, qe) over the keys [lo, hi); q, k, v, sinks in fp32."""
    groups = q.shape[1] // k.shape[1]
    qc = q[qs:qe]  # [n, Hq, D]
    kc = k[lo:hi].repeat_interleave(groups, dim=1)  # query head h reads key/value head h // groups
    vc = v[lo:hi].repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", qc, kc) * scale
    qpos = torch.arange(qs, qe, device=q.device)[:, None]
    kpos = torch.arange(lo, hi, device=q.device)[None, :]
    visible = kpos <= qpos
    if window is not None:
        visible = visible & (qpos - kpos < window)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # unscaled, in the denominator only
        scores = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, qe - qs, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : hi - lo]
    return torch.einsum("hnm,mhe->nhe", probs, vc)


def chunked_varlen_attention(q, k, v, cu_seqlens, *, scale, window, sinks):
    """[T, Hq, Dv] in q's dtype: packed causal attention with optional window (``q - k < window``) and sinks."""
    bounds = [int(x) for x in cu_seqlens.tolist()]
    # One cast for the whole call, not one per chunk: a key's gradient then sums its chunks' parts in fp32
    # and is rounded to k's dtype once (casting per chunk would accumulate dK and dV in bf16).
    qf, kf, vf = q.float(), k.float(), v.float()
    sf = None if sinks is None else sinks.float()
    pieces = []
    for doc_start, doc_end in itertools.pairwise(bounds):
        for qs in range(doc_start, doc_end, CHUNK):
            qe = min(qs + CHUNK, doc_end)
            lo, hi = _key_span(doc_start, qs, qe, window)
            pieces.append(_chunk(qf, kf, vf, qs, qe, lo, hi, scale=scale, window=window, sinks=sf))
    if not pieces:
        return q.new_zeros(0, q.shape[1], v.shape[2])
    return torch.cat(pieces, dim=0).to(q.dtype)
