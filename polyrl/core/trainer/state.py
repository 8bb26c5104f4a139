"""Everything mutable the loop owns besides models, optimizers and schedulers: the resumable state.

``TrainerState.state_dict()`` is what a checkpoint stores under "trainer" (plain Python and tensors,
loadable with ``weights_only=True``): the step, the prompt stream position (the task rng and the task's own
``state_dict``), the sampling and shuffling generators, the KL controller and the non-finite update counters.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass
class Counters:
    """Updates skipped because the loss or grad norm was not finite: in all, and in a row (the abort rule)."""

    nonfinite_skipped: int = 0
    nonfinite_in_row: int = 0


class TrainerState:
    def __init__(self, seed: int, task: Any, kl_ctrl: Any, generator: Callable[[int], torch.Generator]) -> None:
        """``generator(seed)``: the backend's generator factory (``Backend.generator``, CPU generators for every
        built-in backend, so the saved states load on any backend)."""
        self.step = 0  # training steps completed
        self.task = task
        self.task_rng = random.Random(seed)
        self.sample_gen = generator(seed + 1)  # per-sequence sampling seeds
        self.shuffle_gen = generator(seed + 2)  # mini-batch shuffles
        self.kl_ctrl = kl_ctrl
        self.counters = Counters()  # the only one: loaded in place on resume, never replaced

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.task_rng.getstate()
        return {
            "step": self.step,
            "task_rng": [version, list(internal), gauss],
            "task": self.task.state_dict() if hasattr(self.task, "state_dict") else {},
            "sample_gen": self.sample_gen.get_state(),
            "shuffle_gen": self.shuffle_gen.get_state(),
            "kl_ctrl": self.kl_ctrl.state_dict() if self.kl_ctrl is not None else {},
            "counters": dataclasses.asdict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        version, internal, gauss = state["task_rng"]
        self.task_rng.setstate((version, tuple(internal), gauss))
        if state.get("task") and hasattr(self.task, "load_state_dict"):
            # polyrl 0.1 checkpoints stored the task's private attributes ("_next_group", ...)
            self.task.load_state_dict({k.lstrip("_"): v for k, v in state["task"].items()})
        self.sample_gen.set_state(state["sample_gen"])
        self.shuffle_gen.set_state(state["shuffle_gen"])
        if self.kl_ctrl is not None and state.get("kl_ctrl"):
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        # In place: ``self.counters`` is the one object the updates count on (``Trainer.update`` hands it to them).
        # 0.1 checkpoints also hold five rollout totals that nothing read; only the fields of today are kept.
        for f in dataclasses.fields(Counters):
            setattr(self.counters, f.name, int(state["counters"].get(f.name, 0)))
