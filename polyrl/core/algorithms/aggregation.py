"""Loss aggregation: turning a [B, T] per-token loss matrix into the scalar that is differentiated.

Design choice: every mode is defined on the *whole mini-batch* (all gradient-accumulation micro-batches
on all data-parallel ranks). A micro-batch therefore never computes "its own mean"; it computes its
*share* of the mini-batch aggregate, i.e. a masked sum divided by a global count. Summing the shares
(gradient accumulation) and summing over ranks gives exactly the mini-batch aggregate, so the gradient
of a mini-batch does not depend on how it is split.

Modes (``m`` is the 0/1 mask, ``l`` the loss matrix, sums over the mini-batch):
- ``token-mean``:              sum(l·m) / N_tok              N_tok = number of valid tokens
- ``seq-mean-token-sum``:      sum_i (sum_t l·m) / N_seq      N_seq = number of sequences with >= 1 valid token
- ``seq-mean-token-mean``:     sum_i (sum_t l·m / n_i) / N_seq
- ``seq-mean-token-sum-norm``: sum_i (sum_t l·m) / (N_seq · L_max)   Dr.GRPO: a constant length normaliser

Data parallelism: ``global_token_count`` / ``global_seq_count`` all-reduce (SUM) the counts over the
default process group when ``torch.distributed`` is initialised. Each rank then back-propagates its
share. Those shares already sum to the mini-batch aggregate, so the gradient reduction across ranks must
SUM; FSDP/DDP *average* by default, hence a trainer using them multiplies its loss by the data-parallel
world size (or sets the reduce op to sum).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _as_list(masks: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(masks, torch.Tensor):
        return [masks]
    return list(masks)


def _all_reduce_sum(value: torch.Tensor, group: object | None) -> torch.Tensor:
    """SUM-all-reduce ``value`` over the ranks of a multi-process run; identity in one process (also where a
    process group of world size 1 exists: an in-process vLLM engine sets one up for itself)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def global_token_count(mask: torch.Tensor | Sequence[torch.Tensor], group: object | None = None) -> int:
    """Number of valid tokens in the whole mini-batch, over all micro-batches and all ranks.

    Args:
        mask: [B, T] 0/1 mask, or a sequence of them (one per micro-batch of this rank's mini-batch).
        group: process group for the all-reduce (None = default group). Ignored when
            the run is one process (a group of world size 1 included). Every rank of the group must call this.
    Returns:
        the global count as a Python int (the denominator of ``token-mean``).
    """
    masks = _as_list(mask)
    local = sum(int(m.detach().bool().sum().item()) for m in masks)
    # int64: exact for any realistic count (fp32 would round above 2^24 tokens)
    total = torch.tensor([local], dtype=torch.int64, device=masks[0].device)
    return int(_all_reduce_sum(total, group).item())


def global_seq_count(mask: torch.Tensor | Sequence[torch.Tensor], group: object | None = None) -> int:
    """Number of sequences (rows with at least one valid token) over all micro-batches and ranks.

    Args:
        mask: [B, T] 0/1 mask, or a sequence of them. group: as in ``global_token_count``.
    Returns:
        the global count as a Python int (the denominator of the ``seq-mean-*`` modes).
    """
    masks = _as_list(mask)
    local = sum(int((m.detach().bool().sum(-1) > 0).sum().item()) for m in masks)
    total = torch.tensor([local], dtype=torch.int64, device=masks[0].device)
    return int(_all_reduce_sum(total, group).item())


def token_mean_scale(mask_micro: torch.Tensor, global_tokens: int | float) -> float:
    """Factor that turns a micro-batch's *local* token mean into its share of the global token mean.

    ``masked_mean(l, m_micro) * token_mean_scale(m_micro, N)`` == ``sum(l·m_micro) / N``.
    Prefer ``aggregate(..., global_tokens=N)``, which computes the share directly.

    Args:
        mask_micro: [B, T] mask of the micro-batch. global_tokens: from ``global_token_count``.
    """
    if global_tokens <= 0:
        raise ValueError(f"global_tokens must be > 0, got {global_tokens}")
    return float(mask_micro.detach().sum().item()) / float(global_tokens)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values·mask) over ``dim`` (all dims when None). Masked entries never leak (NaN-safe)."""
    prod = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the valid entries (0 when there are none)."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: int | float | None = None,
    global_seqs: int | float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar (see the module docstring for the formulas).

    Args:
        loss_mat: [B, T] per-token loss. mask: [B, T] 0/1 (bool or float) response mask.
        mode: one of ``AGG_MODES``.
        global_tokens: valid tokens of the whole mini-batch (``global_token_count``); ``token-mean`` only.
            When None, this call *is* the whole mini-batch: the local count is used.
        global_seqs: sequences of the whole mini-batch (``global_seq_count``); ``seq-mean-*`` only.
        max_len: the constant length normaliser of ``seq-mean-token-sum-norm`` (pass the configured
            max response length so it stays constant across steps); defaults to T.
    Returns:
        0-d tensor: the aggregate, or this micro-batch's share of it when global counts are given.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {AGG_MODES}")
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} differ")
    fmask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        denom = fmask.sum().clamp(min=1) if global_tokens is None else float(global_tokens)
        return masked_sum(loss_mat, mask) / denom

    n_tok = fmask.sum(-1)  # [B]
    seq_sum = masked_sum(loss_mat, mask, dim=-1)  # [B]
    n_seq = (n_tok > 0).to(loss_mat.dtype).sum().clamp(min=1) if global_seqs is None else float(global_seqs)
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / n_seq
    if mode == "seq-mean-token-mean":
        return (seq_sum / n_tok.clamp(min=1)).sum() / n_seq
    norm = float(max_len if max_len is not None else loss_mat.shape[-1])
    return seq_sum.sum() / (n_seq * norm)
