"""The RL trainer: ``Trainer.train()`` (the run) and its step's stages (``collect`` → ``prepare_update`` →
``update``), with the typed data between them. docs/step.md describes the flow."""

from polyrl.core.trainer.experience import Experience, Generation, RolloutCounts, TrainingAborted
from polyrl.core.trainer.loop import RunFault, RunStopped, Trainer, seed_everything
from polyrl.core.trainer.prepare import UpdateInputs, prepare_update
from polyrl.core.trainer.update import UpdateMetrics

__all__ = ["Experience", "Generation", "RolloutCounts", "RunFault", "RunStopped", "Trainer", "TrainingAborted", "UpdateInputs",
           "UpdateMetrics", "prepare_update", "seed_everything"]
