"""KL estimators and the KL-in-reward penalty with fixed / adaptive coefficient controllers.

Per-token estimators of KL(π‖π_ref) from log-probs of the sampled token (d = logp − ref_logp):
- k1 (alias "kl"): d                        unbiased, high variance, can be negative
- abs:             |d|
- k2 (alias "mse"): ½·d²
- k3 (alias "low_var_kl"): exp(−d) + d − 1 with −d clamped to ±20 and the result to [−10, 10];
  unbiased, non-negative, low variance (Schulman's k3).

KL in the reward (PPO): r_t = score_t − β·kl_t, with β from a controller. The adaptive controller moves β
so that the measured KL tracks a target: err = clip(kl/target − 1, ±0.2); β ← β·(1 + err·n_steps/horizon).
"""

from __future__ import annotations

from typing import Any

import torch

from polyrl.core.algorithms.aggregation import masked_mean

KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference, same shape as the inputs.

    Args: logp, ref_logp: [B, T] log-probs of the sampled tokens. kind: one of ``KL_KINDS``.
    Returns: [B, T] (unmasked; mask it or aggregate it yourself).
    """
    diff = logp - ref_logp
    if kind in ("k1", "kl"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        kl = torch.clamp(-diff, -20.0, 20.0)  # log(ref/π)
        return torch.clamp(torch.exp(kl) - kl - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS}")


class FixedKLController:
    """Constant KL coefficient β. ``update`` is a no-op; state is kept for a uniform checkpoint API."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept for interface parity with ``AdaptiveKLController``)."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): β tracks a target KL over a horizon of samples.

    Args: init_kl_coef: starting β. target: target KL per sequence. horizon: samples over which β may
    change by a factor of e^{±0.2}.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target ({target}) and horizon ({horizon}) must be > 0")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """β ← β·(1 + clip(current_kl/target − 1, −0.2, 0.2)·n_steps/horizon)."""
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))


KLController = FixedKLController | AdaptiveKLController


@torch.no_grad()
def compute_kl_in_reward(
    token_scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kl_ctrl: KLController,
    kind: str = "k1",
    *,
    update: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Subtract β·kl from the token scores: r_t = score_t − β·kl_t·m_t.

    ``current_kl`` is the mean over sequences of each sequence's masked mean KL; the controller is
    updated with it and ``n_steps`` = batch size (set ``update=False`` to update it yourself).

    Args:
        token_scores: [B, T] task rewards (score on the last token). logp: [B, T] behaviour (rollout)
            log-probs. ref_logp: [B, T]. mask: [B, T]. kl_ctrl: a controller. kind: KL estimator.
    Returns:
        (token_rewards [B, T], {"kl": current_kl, "kl_coef": β used for this batch}).
    """
    kld = kl_penalty(logp.float(), ref_logp.float(), kind) * mask.float()
    beta = kl_ctrl.value
    rewards = token_scores - beta * kld.to(token_scores.dtype)
    current_kl = float(masked_mean(kld, mask, dim=-1).mean().item())
    if update:
        kl_ctrl.update(current_kl, n_steps=token_scores.shape[0])
    return rewards, {"kl": current_kl, "kl_coef": beta}
