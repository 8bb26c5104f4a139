"""The trainer's resumable state: one set of counters, loaded in place; the finite-weights check."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from polyrl.core.trainer.loop import Trainer
from polyrl.core.trainer.state import TrainerState


def test_loading_keeps_the_counters_object_the_updates_count_on() -> None:
    saved = TrainerState(0, SimpleNamespace(), None, lambda seed: torch.Generator().manual_seed(seed))
    saved.counters.nonfinite_skipped, saved.counters.nonfinite_in_row = 3, 1
    state = TrainerState(0, SimpleNamespace(), None, lambda seed: torch.Generator().manual_seed(seed))
    counters = state.counters  # what Trainer.update hands to the updates
    checkpoint = saved.state_dict()
    checkpoint["counters"]["rollout_totals"] = 5  # 0.1 checkpoints hold more fields: dropped
    state.load_state_dict(checkpoint)
    assert state.counters is counters
    assert (counters.nonfinite_skipped, counters.nonfinite_in_row) == (3, 1)
    assert state.task_rng.getstate() == random.Random(0).getstate()


def test_weights_finite_is_every_element_finite() -> None:
    actor, critic = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    trainer = SimpleNamespace(models=SimpleNamespace(actor=actor, critic=critic))
    with torch.no_grad():
        critic.weight[0, 1] = 3e38  # finite, its square is not: a max, not a 2-norm, decides
        assert Trainer.weights_finite(trainer)
        for bad in (float("nan"), float("inf"), -float("inf")):
            critic.bias[0] = bad
            assert not Trainer.weights_finite(trainer)
        critic.bias[0] = 0.0
        critic.bias.data = critic.bias.data[:0]  # an empty shard (a rank's part of a small parameter)
        assert Trainer.weights_finite(trainer)
