"""The expert exchange: the default dispatch and combine of an expert-parallel MoE layer (the collectives part's
``expert_dispatch`` / ``expert_combine``), around a backend's ``all_to_all``.

Dispatch turns every (token, expert) pair into one row, sorts the rows by expert (so by the rank that holds it),
exchanges the per-expert row counts (``all_to_all`` of E integers), then the rows themselves (``all_to_all`` with
the variable split sizes those counts give; no capacity, no token is ever dropped), and groups the received rows
by local expert. Combine sends the experts' rows back by the inverse exchange and weights and sums each token's k
rows. Backward runs the same two row exchanges in reverse (the all-to-all's gradient is the all-to-all with the
split sizes swapped).

It takes the ``all_to_all`` function, not a backend, so that it depends on nothing above torch.distributed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# ``Collectives.all_to_all``: (output, input, output_split_sizes, input_split_sizes, group) -> None.
AllToAll = Callable[[torch.Tensor, torch.Tensor, "list[int] | None", "list[int] | None", "ProcessGroup | None"], None]


@dataclasses.dataclass
class ExpertDispatch:
    """What ``dispatch`` hands the local experts and ``combine`` needs to bring their rows back.

    ``tokens`` [N, H]: the rows this rank's experts compute, grouped by local expert (ascending); ``expert_ids``
    [N]: their local expert index. The rest is the default implementation's bookkeeping (a backend's fused
    dispatch keeps its own in ``state``)."""

    tokens: torch.Tensor
    expert_ids: torch.Tensor
    shape: tuple[int, int]  # (T, k) of the tokens dispatched
    order: torch.Tensor | None = None  # slot permutation: slot order -> sorted by global expert
    regroup: torch.Tensor | None = None  # received order -> grouped by local expert
    send_splits: list[int] | None = None  # rows sent to each rank of the group
    recv_splits: list[int] | None = None  # rows received from each rank of the group
    group: ProcessGroup | None = None
    state: Any = None  # a fused dispatch's own bookkeeping


class _AllToAll(torch.autograd.Function):
    """``all_to_all`` of rows with autograd: the gradient goes back by the inverse exchange."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, all_to_all: AllToAll, group: ProcessGroup | None,
                out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.all_to_all, ctx.group, ctx.out_splits, ctx.in_splits = all_to_all, group, out_splits, in_splits
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        all_to_all(out, rows.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        ctx.all_to_all(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group)
        return back, None, None, None, None


def all_to_all_rows(all_to_all: AllToAll, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group: ProcessGroup | None) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``rows`` (block r, ``in_splits[r]`` rows, goes to rank r)."""
    return _AllToAll.apply(rows, all_to_all, group, out_splits, in_splits)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def group_size(group: ProcessGroup | None) -> int:
    import torch.distributed as dist

    return 1 if group is None else dist.get_world_size(group)


def dispatch(all_to_all: AllToAll, hidden: torch.Tensor, expert_ids: torch.Tensor, *, num_experts: int,
             group: ProcessGroup | None = None) -> ExpertDispatch:
    """The default ``Collectives.expert_dispatch`` (contract there), exchanging through ``all_to_all``."""
    T, k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    # A stable sort keeps a token's rows for one expert in token order: the same rows, in the same order, on
    # every ep size, so an expert sees its rows in one order whatever the split.
    order = torch.argsort(flat, stable=True)
    rows = hidden[order // k]
    ep = group_size(group)
    if ep == 1:
        return ExpertDispatch(rows, flat[order], (T, k), order=order)
    local = num_experts // ep
    counts = torch.bincount(flat, minlength=num_experts)  # rows for each global expert
    recv_counts = torch.empty_like(counts)  # [ep, local]: rows each rank sends to each of this rank's experts
    all_to_all(recv_counts, counts, None, None, group)
    send_splits = counts.view(ep, local).sum(1).tolist()
    recv_splits = recv_counts.view(ep, local).sum(1).tolist()
    received = all_to_all_rows(all_to_all, rows, recv_splits, send_splits, group)
    # Received: source rank 0's rows (by local expert), then rank 1's, ...; group them by local expert.
    ids = torch.arange(local, device=flat.device).repeat(ep).repeat_interleave(recv_counts)
    regroup = torch.argsort(ids, stable=True)
    return ExpertDispatch(received[regroup], ids[regroup], (T, k), order=order, regroup=regroup,
                          send_splits=send_splits, recv_splits=recv_splits, group=group)


def combine(all_to_all: AllToAll, expert_out: torch.Tensor, dispatched: ExpertDispatch,
            weights: torch.Tensor) -> torch.Tensor:
    """The default ``Collectives.expert_combine`` (contract there), exchanging through ``all_to_all``."""
    T, k = dispatched.shape
    rows = expert_out
    if dispatched.regroup is not None:
        rows = all_to_all_rows(all_to_all, rows[_inverse(dispatched.regroup)], dispatched.send_splits,
                               dispatched.recv_splits, dispatched.group)
    slots = rows[_inverse(dispatched.order)].view(T, k, -1)
    # As transformers' grouped experts: weighted rows summed over k in the weights' dtype, then the tokens' dtype.
    return (slots * weights.unsqueeze(-1)).sum(dim=1).to(expert_out.dtype)
