"""GAE and GRPO advantages: hand-worked cases and hypothesis properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.core import algorithms as A


def test_gae_hand_worked_no_mask() -> None:
    # r = [0, 0, 1], V = [0.5, 0.2, 0.1], γ = 0.9, λ = 0.8
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.2, 0.1]])
    m = torch.ones(1, 3)
    adv, ret = A.gae_advantages(r, v, m, 0.9, 0.8, whiten=False)
    d2 = 1.0 + 0.9 * 0.0 - 0.1  # 0.9
    d1 = 0.0 + 0.9 * 0.1 - 0.2  # -0.11
    d0 = 0.0 + 0.9 * 0.2 - 0.5  # -0.32
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2]]))
    torch.testing.assert_close(ret, adv + v)


def test_gae_masked_carry() -> None:
    """A masked token in the middle is skipped: value and advantage pass through it unchanged."""
    r = torch.tensor([[0.0, 5.0, 1.0]])  # the reward and value on the masked token (5, 9) are ignored
    v = torch.tensor([[0.5, 9.0, 0.1]])
    m = torch.tensor([[1.0, 0.0, 1.0]])
    adv, _ = A.gae_advantages(r, v, m, 0.9, 0.8, whiten=False)
    a2 = 1.0 - 0.1
    # t = 1 is masked: its δ is computed but discarded; it stores the carried advantage a2.
    # t = 0 sees V_next = V_2 = 0.1 and A_next = a2 (the carry), not V_1 = 9.
    a0 = (0.0 + 0.9 * 0.1 - 0.5) + 0.72 * a2
    torch.testing.assert_close(adv, torch.tensor([[a0, a2, a2]]))


def test_gae_whitening_unbiased() -> None:
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    v = torch.zeros(2, 4)
    m = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    raw, _ = A.gae_advantages(r, v, m, 1.0, 1.0, whiten=False)
    white, _ = A.gae_advantages(r, v, m, 1.0, 1.0)
    vals = raw[m.bool()]  # [1, 0, 2, 2, 0]
    mean = vals.mean()
    var = ((vals - mean) ** 2).sum() / (vals.numel() - 1)  # n/(n-1)
    expected = (raw - mean) / math.sqrt(var.item() + 1e-8) * m
    torch.testing.assert_close(white, expected)
    assert white[~m.bool()].abs().sum() == 0


def test_whiten_single_entry_is_zero() -> None:
    out = A.masked_whiten(torch.tensor([[3.0, 7.0]]), torch.tensor([[1.0, 0.0]]))
    torch.testing.assert_close(out, torch.zeros(1, 2))


@settings(max_examples=50, deadline=None)
@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_gae_gamma_lambda_one_is_reward_to_go(B: int, T: int, seed: int, data: st.DataObject) -> None:
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
    m = (torch.arange(T)[None] < lengths[:, None]).double()
    r = r * m
    adv, ret = A.gae_advantages(r, torch.zeros(B, T), m, 1.0, 1.0, whiten=False)
    rtg = r.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(adv[m.bool()].double(), rtg[m.bool()], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, adv)


def test_grpo_hand_worked() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0])
    ids = ["a", "a", "a", "b", "b"]
    adv = A.group_advantages(scores, ids)
    mean_a, std_a = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased
    mean_b, std_b = 3.0, math.sqrt(2.0)
    expected = [
        (1 - mean_a) / (std_a + 1e-6),
        -mean_a / (std_a + 1e-6),
        -mean_a / (std_a + 1e-6),
        (2 - mean_b) / (std_b + 1e-6),
        (4 - mean_b) / (std_b + 1e-6),
    ]
    torch.testing.assert_close(adv, torch.tensor(expected))
    no_std = A.group_advantages(scores, ids, norm_by_std=False)
    torch.testing.assert_close(no_std, torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0]))


def test_grpo_singleton_and_constant_groups() -> None:
    scores = torch.tensor([3.0, 1.0, 1.0])
    adv = A.group_advantages(scores, torch.tensor([7, 8, 8]))
    # singleton: mean 0, std 1 -> 3 / (1 + 1e-6); constant group: 0 / (0 + eps) = 0
    torch.testing.assert_close(adv, torch.tensor([3.0 / (1 + 1e-6), 0.0, 0.0]))


def test_group_ids_length_checked() -> None:
    with pytest.raises(ValueError):
        A.group_advantages(torch.zeros(3), [1, 2])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(2, 6), min_size=1, max_size=5),
    seed=st.integers(0, 2**31 - 1),
    norm=st.booleans(),
)
def test_group_advantages_sum_to_zero(sizes: list[int], seed: int, norm: bool) -> None:
    ids = [f"p{i}" for i, n in enumerate(sizes) for _ in range(n)]
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))
    ids = [ids[i] for i in perm]  # groups interleaved
    scores = torch.randint(0, 3, (len(ids),), generator=torch.Generator().manual_seed(seed + 1)).float()
    adv = A.group_advantages(scores, ids, norm_by_std=norm)
    for gid in set(ids):
        idx = [i for i, x in enumerate(ids) if x == gid]
        assert abs(adv[idx].sum().item()) < 1e-4


def test_sequence_scores_and_broadcast() -> None:
    r = torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.5, 9.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    s = A.sequence_scores(r, m)
    torch.testing.assert_close(s, torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(A.broadcast_to_tokens(s * 2, m), torch.tensor([[2.0, 2.0, 2.0], [2.0, 2.0, 0.0]]))


def test_last_token_rewards() -> None:
    m = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    out = A.last_token_rewards(torch.tensor([1.0, -1.0, 5.0]), m)
    torch.testing.assert_close(out, torch.tensor([[0, 1.0, 0, 0], [0, 0, 0, -1.0], [0, 0, 0, 0]]))
    torch.testing.assert_close(A.sequence_scores(out, m), torch.tensor([1.0, -1.0, 0.0]))
