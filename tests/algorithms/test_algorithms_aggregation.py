"""Aggregation modes: hand-worked values, and split invariance of loss and gradient (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.core import algorithms as A

# Two sequences: row 0 has 3 valid tokens, row 1 has 1; the masked entries hold garbage (100, NaN).
LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, float("nan"), 100.0, 100.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-sum", (6 + 4) / 2),  # 5
        ("seq-mean-token-mean", (6 / 3 + 4 / 1) / 2),  # 3
        ("seq-mean-token-sum-norm", (6 + 4) / (2 * 4)),  # 1.25, max_len = T = 4
    ],
)
def test_aggregate_hand_worked(mode: str, expected: float) -> None:
    assert A.aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_uses_max_len() -> None:
    assert A.aggregate(LOSS, MASK, "seq-mean-token-sum-norm", max_len=10).item() == pytest.approx(10 / 20)


def test_empty_rows_do_not_count_as_sequences() -> None:
    mask = torch.cat([MASK, torch.zeros(1, 4, dtype=MASK.dtype)])
    loss = torch.cat([LOSS, torch.ones(1, 4)])
    assert A.aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    assert A.global_seq_count(mask) == 2
    assert A.global_token_count(mask) == 4


def test_global_counts_give_the_share() -> None:
    # This micro-batch is part of a mini-batch with 10 tokens / 5 sequences.
    assert A.aggregate(LOSS, MASK, "token-mean", global_tokens=10).item() == pytest.approx(10 / 10)
    assert A.aggregate(LOSS, MASK, "seq-mean-token-sum", global_seqs=5).item() == pytest.approx(10 / 5)
    assert A.aggregate(LOSS, MASK, "seq-mean-token-mean", global_seqs=5).item() == pytest.approx(6 / 5)
    assert A.aggregate(LOSS, MASK, "seq-mean-token-sum-norm", global_seqs=5, max_len=8).item() == pytest.approx(10 / 40)


def test_token_mean_scale() -> None:
    local = A.masked_mean(LOSS, MASK)
    assert (local * A.token_mean_scale(MASK, 10)).item() == pytest.approx(
        A.aggregate(LOSS, MASK, global_tokens=10).item()
    )
    with pytest.raises(ValueError):
        A.token_mean_scale(MASK, 0)


def test_global_counts_accept_lists() -> None:
    assert A.global_token_count([MASK, MASK]) == 8
    assert A.global_seq_count([MASK, MASK[:1]]) == 3


def test_unknown_mode_and_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        A.aggregate(LOSS, MASK, "mean")
    with pytest.raises(ValueError):
        A.aggregate(LOSS, MASK[:, :3], "token-mean")


@st.composite
def batches_and_splits(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    B = draw(st.integers(1, 8))
    T = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g, dtype=torch.float64)
    target = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.tensor(draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
    if int(lengths.sum()) == 0:
        lengths[0] = 1
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    cuts = sorted(set(draw(st.lists(st.integers(1, B - 1), max_size=B - 1)))) if B > 1 else []
    return x, target, mask, cuts


@settings(max_examples=60, deadline=None)
@given(data=batches_and_splits(), mode=st.sampled_from(A.AGG_MODES))
def test_loss_and_grad_do_not_depend_on_the_split(data, mode: str) -> None:
    """Summing the micro-batch shares (gradient accumulation) equals the whole mini-batch, value and grad."""
    x, target, mask, cuts = data
    T = x.shape[1]

    def per_token(p: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return (p - tgt) ** 2 * p.tanh()

    full_p = x.clone().requires_grad_()
    full = A.aggregate(per_token(full_p, target), mask, mode, max_len=T + 3)
    full.backward()

    n_tok, n_seq = A.global_token_count(mask), A.global_seq_count(mask)
    split_p = x.clone().requires_grad_()
    bounds = [0, *cuts, x.shape[0]]
    total = torch.zeros((), dtype=torch.float64)
    for lo, hi in itertools.pairwise(bounds):
        share = A.aggregate(
            per_token(split_p[lo:hi], target[lo:hi]),
            mask[lo:hi],
            mode,
            global_tokens=n_tok,
            global_seqs=n_seq,
            max_len=T + 3,
        )
        share.backward()
        total = total + share.detach()
    torch.testing.assert_close(total, full.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split_p.grad, full_p.grad, rtol=1e-12, atol=1e-12)


def test_naive_micro_batch_mean_is_split_dependent() -> None:
    """The trap the global count avoids: averaging per-micro-batch token means is not the token mean."""
    loss = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    naive = (A.aggregate(loss[:1], mask[:1]) + A.aggregate(loss[1:], mask[1:])) / 2
    exact = A.aggregate(loss[:1], mask[:1], global_tokens=4) + A.aggregate(loss[1:], mask[1:], global_tokens=4)
    assert exact.item() == pytest.approx(A.aggregate(loss, mask).item()) == pytest.approx(7 / 4)
    assert naive.item() == pytest.approx(2.5)
