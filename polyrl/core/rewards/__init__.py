"""Rewards: scoring responses robustly (``score_batch``) and the math reward.

- :func:`score_batch` — the one entry point the trainer calls; never raises for a failing reward.
- :mod:`polyrl.core.rewards.math` — DAPO-style answer extraction + math-verify, +1 / -1.
- :mod:`polyrl.core.rewards.pool` — the time-bounded worker pool behind slow rewards.
"""

from __future__ import annotations

from polyrl.core.rewards.batch import DEFAULT_TIMEOUT_S, RewardFn, ScoreStats, score_batch

__all__ = ["DEFAULT_TIMEOUT_S", "RewardFn", "ScoreStats", "score_batch"]
