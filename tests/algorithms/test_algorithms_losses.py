"""Policy, value and entropy losses: hand-worked cases and the inside-the-clip-range property."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.core import algorithms as A


def _lp(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.zeros(1, len(ratios))
    return torch.log(torch.tensor([ratios])), old


def test_policy_loss_clip_higher_hand_worked() -> None:
    # ratios and advantages chosen to hit each branch; ε_low = 0.2, ε_high = 0.28
    logp, old = _lp([1.5, 1.5, 0.5, 0.5, 1.1])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 2.0]])
    mask = torch.ones(1, 5)
    loss, met = A.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # per token max(−A r, −A clip(r)):
    # A=+1,r=1.5: max(−1.5, −1.28) = −1.28 (clipped) | A=−1,r=1.5: max(1.5, 1.28) = 1.5
    # A=+1,r=0.5: max(−0.5, −0.8) = −0.5             | A=−1,r=0.5: max(0.5, 0.8) = 0.8 (clipped)
    # A=+2,r=1.1: −2.2 (inside)
    expected = [-1.28, 1.5, -0.5, 0.8, -2.2]
    assert loss.item() == pytest.approx(sum(expected) / 5, rel=1e-6)
    assert met["pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert met["ppo_kl"].item() == pytest.approx(-float(logp.mean()), rel=1e-6)
    assert met["pg_clipfrac_lower"].item() == 0


def test_policy_loss_dual_clip() -> None:
    logp, old = _lp([5.0, 5.0, 0.5])
    adv = torch.tensor([[-1.0, 1.0, -2.0]])
    mask = torch.ones(1, 3)
    loss, met = A.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0)
    # A=−1,r=5: clip1 = max(5, 1.2) = 5 -> min(3, 5) = 3 (dual clip) ; A=+1,r=5: −1.2 (no dual clip for A>0)
    # A=−2,r=0.5: clip1 = max(1.0, 1.6) = 1.6 -> min(6, 1.6) = 1.6
    assert loss.item() == pytest.approx((3.0 - 1.2 + 1.6) / 3, rel=1e-6)
    assert met["pg_clipfrac_lower"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        A.policy_loss(logp, old, adv, mask, clip_c=1.0)


def test_policy_loss_gradient_zero_when_clipped_and_masked() -> None:
    logp = torch.log(torch.tensor([[1.5, 1.1, 1.1]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = A.policy_loss(logp, torch.zeros(1, 3), adv, mask, clip_low=0.2, clip_high=0.2)
    loss.backward()
    # token 0 clipped -> 0; token 1 inside -> d(−r)/dlogp / 2 = −1.1/2; token 2 masked -> 0
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.55, 0.0]]))


def test_policy_loss_log_ratio_clamped() -> None:
    logp = torch.tensor([[100.0]])
    loss, met = A.policy_loss(logp, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1))
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-5)
    assert met["ppo_kl"].item() == pytest.approx(-20.0)


@settings(max_examples=80, deadline=None)
@given(
    r=st.floats(0.81, 1.19),
    a=st.floats(-5, 5, allow_nan=False),
    clip_c=st.sampled_from([None, 3.0, 10.0]),
)
def test_policy_loss_inside_clip_range_is_minus_a_ratio(r: float, a: float, clip_c: float | None) -> None:
    logp = torch.tensor([[math.log(r)]], dtype=torch.float64)
    adv = torch.tensor([[a]], dtype=torch.float64)
    loss, _ = A.policy_loss(
        logp, torch.zeros_like(logp), adv, torch.ones(1, 1), clip_low=0.2, clip_high=0.28, clip_c=clip_c
    )
    assert loss.item() == pytest.approx(-a * r, rel=1e-9, abs=1e-12)


def test_policy_loss_forwards_globals() -> None:
    logp, old = _lp([1.0, 1.0])
    adv = torch.tensor([[1.0, 3.0]])
    loss, _ = A.policy_loss(logp, old, adv, torch.ones(1, 2), global_tokens=8)
    assert loss.item() == pytest.approx(-4 / 8)
    loss, _ = A.policy_loss(logp, old, adv, torch.ones(1, 2), agg="seq-mean-token-sum", global_seqs=4)
    assert loss.item() == pytest.approx(-4 / 4)


def test_value_loss_hand_worked() -> None:
    v = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 2.2, 0.0]])
    ret = torch.tensor([[3.0, 0.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, met = A.value_loss(v, old, ret, mask, clip=0.5)
    # t0: (1−3)² = 4 vs (clamp(1, −.5, .5) − 3)² = 6.25 -> 6.25 (clipped larger)
    # t1: (2−0)² = 4 vs (clamp(2, 1.7, 2.7) − 0)² = 4 -> 4
    assert loss.item() == pytest.approx(0.5 * (6.25 + 4) / 2)
    assert met["vf_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # t0 takes the clipped branch: no gradient to v; t1: 0.5 * 2 (v − R) / 2 = 1.0
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 1.0, 0.0]]))
    unclipped, met = A.value_loss(v, old, ret, mask, clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (4 + 4) / 2)
    assert met["vf_clipfrac"].item() == 0


def test_entropy_loss_is_aggregate() -> None:
    ent = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    m = torch.tensor([[1, 0], [1, 1]])
    assert A.entropy_loss(ent, m).item() == pytest.approx(8 / 3)
    assert A.entropy_loss(ent, m, agg="seq-mean-token-mean").item() == pytest.approx((1 + 3.5) / 2)


def test_the_clip_fractions_of_each_side_are_of_the_losss_ratio():
    """Which side of the clip range the ratio hit, from the ratio the loss itself uses (DAPO clip-higher)."""
    ratio = torch.tensor([[1.5, 0.5, 1.1, 1.0, 0.7, 2.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0, -1.0]])  # clipped high, low, inside, inside, wrong side x2
    _, met = A.policy_loss(ratio.log(), torch.zeros(1, 6), adv, torch.ones(1, 6), clip_low=0.2, clip_high=0.28)
    assert met["clipfrac_high"].item() == pytest.approx(1 / 6) and met["clipfrac_low"].item() == pytest.approx(1 / 6)
