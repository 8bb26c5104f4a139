"""KL estimators, KL-in-reward and the coefficient controllers."""

from __future__ import annotations

import math

import pytest
import torch

from polyrl.core import algorithms as A

LOGP = torch.tensor([[-1.0, -2.0, -0.5]])
REF = torch.tensor([[-1.5, -1.0, -0.5]])  # d = logp − ref = [0.5, −1, 0]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", [0.5, -1.0, 0.0]),
        ("kl", [0.5, -1.0, 0.0]),
        ("abs", [0.5, 1.0, 0.0]),
        ("k2", [0.125, 0.5, 0.0]),
        ("mse", [0.125, 0.5, 0.0]),
        # k3: e^{−d} + d − 1
        ("k3", [math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0, 0.0]),
        ("low_var_kl", [math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0, 0.0]),
    ],
)
def test_kl_estimators_hand_worked(kind: str, expected: list[float]) -> None:
    torch.testing.assert_close(A.kl_penalty(LOGP, REF, kind), torch.tensor([expected]))


def test_low_var_kl_is_clamped() -> None:
    out = A.kl_penalty(torch.tensor([[-50.0, 0.0]]), torch.tensor([[0.0, -50.0]]), "low_var_kl")
    # d = −50: ref − logp = 50 clamped to 20 -> e^20 − 21 clamped to 10; d = 50: e^{−20} + 19 -> clamped 10
    torch.testing.assert_close(out, torch.tensor([[10.0, 10.0]]))
    with pytest.raises(ValueError, match="unknown KL"):
        A.kl_penalty(LOGP, REF, "full")


def test_fixed_controller() -> None:
    ctrl = A.FixedKLController(0.01)
    ctrl.update(5.0, 100)
    assert ctrl.value == 0.01
    other = A.FixedKLController(1.0)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.01


def test_adaptive_controller_hand_worked() -> None:
    ctrl = A.AdaptiveKLController(init_kl_coef=0.1, target=0.05, horizon=1000)
    ctrl.update(current_kl=0.06, n_steps=100)  # err = 0.2 -> ×(1 + 0.2·0.1)
    assert ctrl.value == pytest.approx(0.1 * 1.02)
    ctrl.update(current_kl=1.0, n_steps=100)  # err clipped to +0.2
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 1.02)
    ctrl.update(current_kl=0.0, n_steps=500)  # err = −1 clipped to −0.2 -> ×0.9
    assert ctrl.value == pytest.approx(0.1 * 1.02 * 1.02 * 0.9)
    restored = A.AdaptiveKLController(1.0, 1.0, 1)
    restored.load_state_dict(ctrl.state_dict())
    assert (restored.value, restored.target, restored.horizon) == (ctrl.value, 0.05, 1000)
    with pytest.raises(ValueError):
        A.AdaptiveKLController(0.1, 0.0, 10)


def test_kl_in_reward() -> None:
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -2.0, -9.0]])  # k1 = [.5, 0, −.5], [1, 1, 8]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ctrl = A.AdaptiveKLController(0.1, target=1.0, horizon=10)
    rewards, met = A.compute_kl_in_reward(scores, logp, ref, mask, ctrl, "k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.05], [-0.1, 1.9, 0.0]]))
    # current kl = mean over sequences of the per-sequence masked mean: (0 + 1) / 2
    assert met == {"kl": pytest.approx(0.5), "kl_coef": pytest.approx(0.1)}
    assert ctrl.value == pytest.approx(0.1 * (1 + (-0.2) * 2 / 10))  # err clip(−0.5) = −0.2, n_steps = B = 2
    fixed = A.FixedKLController(0.1)
    rewards2, _ = A.compute_kl_in_reward(scores, logp, ref, mask, fixed, "k1", update=False)
    torch.testing.assert_close(rewards2, rewards)
