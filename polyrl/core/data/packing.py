"""How sequences are packed into micro-batches by a token budget (``algorithm.micro_batch_tokens``), and whether
documents are packed at all (``packs_documents``).

One rule, read by the trainer (its forward and update passes split their rows with :func:`pack_rows`) and by the
dry-run memory plan (which sizes one micro-batch with :func:`micro_batch_token_bound`): rows are taken in order
and a micro-batch closes before the row that would take it over the budget; a row longer than the budget is a
micro-batch of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

# The attention implementation that splits packed documents by position_ids (polyrl.core.attention.hf).
PACKING_ATTENTION = "polyrl"


def packs_documents(attn_implementation: str) -> bool:
    """Whether rows are packed documents (one long row, no padding, each document attending only to itself) or
    padded rows: packing needs an attention that splits documents by position_ids, which only polyrl's does; eager
    and sdpa get padded rows and [Hq, S, S] scores. The trainer's learners and the dry-run plan both ask here."""
    return attn_implementation == PACKING_ATTENTION


def pack_rows(lengths: Sequence[int], rows: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Split ``rows`` (in order) into runs whose total length (``lengths[row]``) stays within ``max_tokens``;
    a single row longer than the budget gets a micro-batch of its own."""
    out: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for r in rows:
        n = lengths[r]
        if cur and used + n > max_tokens:
            out.append(cur)
            cur, used = [], 0
        cur.append(r)
        used += n
    if cur:
        out.append(cur)
    return out


def micro_batch_token_bound(max_tokens: int, longest: int) -> int:
    """The most tokens one micro-batch of :func:`pack_rows` can hold when no row is longer than ``longest``:
    the budget, or the longest row when that alone exceeds it (rows whose lengths add up to the budget reach
    the bound)."""
    return max(max_tokens, longest)
