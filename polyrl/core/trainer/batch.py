"""Sequences for the update: padded [B, R] response tensors, and packed forward passes over them.

A training batch keeps one row per sampled sequence: its prompt ids, its response ids, and [B, R]
response-aligned tensors (R = the longest response): ``mask``, rollout log-probs, and later old/ref
log-probs, values, advantages, returns. Forward passes never see [B, R] padding: a micro-batch of rows
is *packed* into one row of concatenated documents whose ``position_ids`` restart at 0 (the layout the
``"polyrl"`` attention turns into ``cu_seqlens``), and the per-token outputs are scattered back to
[b, R]. Attention implementations that cannot pack (eager, sdpa) get a right-padded batch instead.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from polyrl.core import algorithms as A
from polyrl.core.attention.op import validate_cu_seqlens
from polyrl.core.data.packing import pack_rows
from polyrl.core.models.lm_head import fused_logprobs


@dataclasses.dataclass
class SequenceBatch:
    prompts: list[list[int]]
    responses: list[list[int]]
    group_ids: list[object]
    mask: torch.Tensor  # [B, R] float 0/1
    rollout_logp: torch.Tensor  # [B, R] sampling log-probs from the engine
    # Routing replay (rollout.routing_replay): per row, the experts each of its tokens is routed to in the forward
    # passes, [P + R_i - 1, L, k] int on the host (the engine's under r3, the old-log-prob pass's under r2); None: off
    routes: list[torch.Tensor] | None = None

    @property
    def size(self) -> int:
        return len(self.prompts)

    @classmethod
    def from_rollout(
        cls, prompts: list[list[int]], responses: list[list[int]], logprobs: list[list[float]], group_ids: list,
        *, device: torch.device | str = "cpu", routes: list[torch.Tensor] | None = None,
    ) -> SequenceBatch:
        """Built on the host (Python lists), moved to ``device`` (``Backend.device``) in one copy each."""
        B = len(prompts)
        R = max(1, max(len(r) for r in responses))
        mask = torch.zeros(B, R)
        lp = torch.zeros(B, R)
        for i, (resp, resp_lp) in enumerate(zip(responses, logprobs)):
            mask[i, : len(resp)] = 1.0
            lp[i, : len(resp)] = torch.tensor(resp_lp, dtype=torch.float32)
        return cls(list(prompts), list(responses), list(group_ids), mask.to(device), lp.to(device),
                   list(routes) if routes is not None else None)


def micro_batches(lengths: Sequence[int], rows: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Split ``rows`` (in order) into runs whose total length stays within ``max_tokens``
    (:func:`polyrl.core.data.packing.pack_rows`, the rule the dry-run plan sizes micro-batches with), the same
    number on every rank. A single row longer than the budget gets a micro-batch of its own.
    """
    return _same_count_on_every_rank(pack_rows(lengths, rows, max_tokens))


def _same_count_on_every_rank(parts: list[list[int]]) -> list[list[int]]:
    """Under FSDP every forward and backward is a collective, so every rank must run the same number of
    micro-batches: split this rank's largest ones until it has the global maximum (ranks hold equal row
    counts, so there are always enough rows). Identity in a single process."""
    from polyrl.core import distributed as D

    if not D.is_distributed():
        return parts
    target = int(D.all_reduce_(torch.tensor(float(len(parts))), "max").item())
    parts = [list(p) for p in parts]
    while len(parts) < target:
        i = max(range(len(parts)), key=lambda j: len(parts[j]))
        if len(parts[i]) < 2:
            raise RuntimeError(f"cannot split {sum(map(len, parts))} rows into {target} micro-batches")
        half = len(parts[i]) // 2
        parts[i : i + 1] = [parts[i][:half], parts[i][half:]]
    return parts


def _layout(batch: SequenceBatch, rows: Sequence[int], packed: bool, pad_id: int, device: torch.device):
    """Model inputs for ``rows`` and, per row, the flat indices of the positions predicting its response.

    Returns (kwargs for the model, gather index [N] into the flattened [*, T] outputs, scatter (row, col)
    pairs of the [b, R] result). Position p predicts token p + 1, so response token j of a row whose
    prompt has P tokens is predicted at P - 1 + j.
    """
    seqs = [batch.prompts[r] + batch.responses[r] for r in rows]
    gather: list[int] = []
    dst_row: list[int] = []
    dst_col: list[int] = []
    if packed:
        ids: list[int] = []
        pos: list[int] = []
        for i, (r, s) in enumerate(zip(rows, seqs)):
            start = len(ids)
            ids += s
            pos += range(len(s))
            P = len(batch.prompts[r])
            n = len(batch.responses[r])
            gather += range(start + P - 1, start + P - 1 + n)
            dst_row += [i] * n
            dst_col += range(n)
        # Document boundaries built and validated here, on the host, once per micro-batch, and handed to every
        # layer as transformers' ``cu_seq_lens_q/k`` (one tensor object): the attention never reads them back.
        cu = [0, *itertools.accumulate(len(x) for x in seqs)]
        validate_cu_seqlens(cu, len(ids))
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        longest = max(len(x) for x in seqs)
        kwargs = {
            "input_ids": torch.tensor([ids], dtype=torch.long, device=device),
            "position_ids": torch.tensor([pos], dtype=torch.long, device=device),
            "cu_seq_lens_q": cu_t, "cu_seq_lens_k": cu_t, "max_length_q": longest, "max_length_k": longest,
        }
    else:
        L = max(len(s) for s in seqs)
        ids_t = torch.full((len(seqs), L), pad_id, dtype=torch.long, device=device)
        att = torch.zeros((len(seqs), L), dtype=torch.long, device=device)
        for i, (r, s) in enumerate(zip(rows, seqs)):
            ids_t[i, : len(s)] = torch.tensor(s, dtype=torch.long)  # host → device copy per row (unpacked path)
            att[i, : len(s)] = 1
            P = len(batch.prompts[r])
            n = len(batch.responses[r])
            gather += range(i * L + P - 1, i * L + P - 1 + n)
            dst_row += [i] * n
            dst_col += range(n)
        kwargs = {"input_ids": ids_t, "attention_mask": att}
    labels = torch.tensor([t for r in rows for t in batch.responses[r]], dtype=torch.long, device=device)
    dst = (torch.tensor(dst_row, dtype=torch.long, device=device), torch.tensor(dst_col, dtype=torch.long, device=device))
    return kwargs, torch.tensor(gather, dtype=torch.long, device=device), dst, labels


def _routes_for(batch: SequenceBatch, rows: Sequence[int], packed: bool, device: torch.device) -> torch.Tensor:
    """[N, L, k] routes of the forward :func:`_layout` builds for ``rows`` (its flattened token order: packed rows
    concatenated, or [b, longest] padded rows), -1 where a token has none (padding; the last token of a sequence,
    which no engine ran; its output predicts nothing)."""
    per_row = []
    for r in rows:
        route = batch.routes[r]
        n = len(batch.prompts[r]) + len(batch.responses[r])
        if route.shape[0] != n - 1:
            raise ValueError(f"routing replay: row {r} has routes for {route.shape[0]} tokens, its sequence runs "
                             f"{n - 1} (prompt + response - 1)")
        per_row.append(torch.cat([route.long(), route.new_full((1, *route.shape[1:]), -1).long()]))
    if packed:
        return torch.cat(per_row).to(device)
    longest = max(x.shape[0] for x in per_row)
    out = per_row[0].new_full((len(per_row), longest, *per_row[0].shape[1:]), -1)
    for i, x in enumerate(per_row):
        out[i, : x.shape[0]] = x
    return out.flatten(0, 1).to(device)


def split_routes(recorded: torch.Tensor, batch: SequenceBatch, rows: Sequence[int], packed: bool) -> list[torch.Tensor]:
    """Per row of ``rows``, [P + R - 1, L, k] of a forward's recorded routes ``recorded`` [N, L, k] (the inverse of
    :func:`_routes_for`: the sequences' tokens but the last)."""
    lengths = [len(batch.prompts[r]) + len(batch.responses[r]) for r in rows]
    if packed:
        starts = [0, *itertools.accumulate(lengths)][:-1]
    else:
        starts = [i * max(lengths) for i in range(len(rows))]
    return [recorded[s : s + n - 1].to(torch.int16) for s, n in zip(starts, lengths)]


def _declare_routing(replay, batch: SequenceBatch, rows: Sequence[int], packed: bool, record: bool,
                     device: torch.device) -> None:
    """Tell ``replay`` (polyrl.core.models.routing) what this forward routes by: recorded, the batch's routes, or
    the model's own."""
    if record:
        replay.record()
    elif batch.routes is not None:
        replay.force(_routes_for(batch, rows, packed, device))
    else:
        replay.idle()


def _scatter(values: torch.Tensor, dst: tuple[torch.Tensor, torch.Tensor], b: int, R: int) -> torch.Tensor:
    return values.new_zeros(b, R).index_put(dst, values)


def policy_forward(
    model: torch.nn.Module,
    batch: SequenceBatch,
    rows: Sequence[int],
    *,
    packed: bool,
    pad_id: int,
    temperature: float,
    chunk_size: int,
    compute_entropy: bool,
    logprobs: Callable[..., tuple[torch.Tensor, torch.Tensor]] = A.logprobs_and_entropy,
    linear_logprobs: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    replay: Any = None,
    record_routes: bool = False,
    linear_logprob_loss: Callable[..., tuple[torch.Tensor, ...]] | None = None,
    loss_terms: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Log-probs and entropies [b, R] of the responses of ``rows`` under ``model`` (differentiable).

    ``logprobs``: the log-prob kernel on logits (the trainer passes its backend's ``Backend.logprobs``; the
    default is the reference). ``linear_logprobs``: when given (``Backend.linear_logprobs``), the fused path
    instead: the model's last hidden states and lm_head weight go to it and no logits are made
    (polyrl.core.models.lm_head). ``replay``: the model's routing replay (rollout.routing_replay; None: off), which
    then routes this forward by ``batch.routes`` when it has them, or records the model's own routing
    (``record_routes``: read it with ``replay.take_recorded()`` and :func:`split_routes`).

    ``loss_terms`` (with ``linear_logprob_loss``, ``Backend.linear_logprob_loss``): the loss as a function of [b, R]
    log-probs and entropies, a sum of per-token terms (each token's term depends on its own log-prob and entropy
    alone, as every actor loss here: clipped surrogate, KL penalty, entropy bonus, linearly aggregated). Its gradient
    is then taken inside the fused op's forward, chunk by chunk, and the call returns ``(anchor, logp, ent)``:
    logp and ent not differentiable, the anchor a 0-d zero to add to the loss's value, carrying the gradients."""
    device = next(model.parameters()).device
    kwargs, gather, dst, labels = _layout(batch, rows, packed, pad_id, device)
    if replay is not None:
        _declare_routing(replay, batch, rows, packed, record_routes, device)
    kw = dict(chunk_size=chunk_size, temperature=temperature, compute_entropy=compute_entropy)
    R = batch.mask.shape[1]
    if loss_terms is not None:
        if linear_logprob_loss is None:
            raise ValueError("loss_terms needs the fused loss kernel (linear_logprob_loss)")
        token_grad = _token_grad(loss_terms, dst, len(rows), R, device, compute_entropy)

        def kernel(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, **k: Any) -> tuple[torch.Tensor, ...]:
            return linear_logprob_loss(h, w, y, token_grad, **k)

        anchor, logp, ent = fused_logprobs(model, kwargs, gather, labels, kernel, **kw)
        return anchor, _scatter(logp, dst, len(rows), R), _scatter(ent, dst, len(rows), R)
    if linear_logprobs is not None:
        logp, ent = fused_logprobs(model, kwargs, gather, labels, linear_logprobs, **kw)
    else:
        logits = model(**kwargs, use_cache=False).logits  # [1, T, V] or [b, L, V]
        sel = logits.reshape(-1, logits.shape[-1]).index_select(0, gather)  # [N, V]: response positions only
        logp, ent = logprobs(sel, labels, **kw)
    return _scatter(logp, dst, len(rows), R), _scatter(ent, dst, len(rows), R)


def _token_grad(loss_terms: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dst: tuple[torch.Tensor, ...],
                b: int, R: int, device: torch.device, compute_entropy: bool) -> Callable[..., tuple]:
    """The fused loss op's ``token_grad`` for flat response tokens [t0, t1) (``dst``: their [b, R] places): the
    chunk's log-probs and entropies placed into [b, R] zeros, ``loss_terms`` of those, differentiated with respect
    to the chunk's values. Exact for a sum of per-token terms: the other places' values do not reach the chunk's
    gradient."""
    base = torch.zeros(b, R, dtype=torch.float32, device=device)

    def token_grad(t0: int, t1: int, lp: torch.Tensor, ent: torch.Tensor) -> tuple:
        place = (dst[0][t0:t1], dst[1][t0:t1])
        lp_leaf = lp.detach().float().requires_grad_()
        ent_leaf = ent.detach().float().requires_grad_()
        loss = loss_terms(base.index_put(place, lp_leaf), base.index_put(place, ent_leaf))
        g_lp, g_ent = torch.autograd.grad(loss, [lp_leaf, ent_leaf], allow_unused=True)
        return g_lp, (g_ent if compute_entropy else None)

    return token_grad


def value_forward(
    critic: torch.nn.Module, batch: SequenceBatch, rows: Sequence[int], *, packed: bool, pad_id: int
) -> torch.Tensor:
    """Critic values [b, R]: V at the position that predicts each response token (the state before it)."""
    device = next(critic.parameters()).device
    kwargs, gather, dst, _ = _layout(batch, rows, packed, pad_id, device)
    values = critic(**kwargs)  # [1, T] or [b, L]
    sel = values.reshape(-1).index_select(0, gather).float()
    return _scatter(sel, dst, len(rows), batch.mask.shape[1])


@torch.no_grad()
def forward_all(fn: Callable[[list[int]], torch.Tensor], batch: SequenceBatch, max_tokens: int) -> torch.Tensor:
    """Run ``fn`` over micro-batches of the whole batch (no grad) and stitch the [B, R] result."""
    lengths = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]
    out = torch.zeros_like(batch.mask)  # on the batch's device
    for rows in micro_batches(lengths, list(range(batch.size)), max_tokens):
        out[torch.tensor(rows, device=out.device)] = fn(rows).float()
    return out
