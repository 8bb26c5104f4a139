"""Learning-rate schedule: linear warmup, then constant or cosine decay to ``min_lr_ratio``.

The scheduler is stepped once per training step (after all of the step's mini-batch updates), as in
verl, so ``warmup_steps`` and ``total_steps`` count training steps, not optimizer steps.
"""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the base lr at training step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, **kwargs) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, **kwargs))
