"""The RL trainer: ``Trainer.train()`` (the run) and its step's stages (``collect`` → ``prepare_update`` →
``update``), with the typed data and metrics between them. docs/step.md describes the flow."""

from polyrl.core.run.outcome import RunFault, RunStopped, TrainingAborted
from polyrl.core.trainer.experience import Experience, Generation, RolloutCounts
from polyrl.core.trainer.loop import Trainer, seed_everything
from polyrl.core.trainer.metrics import (
    ActorMetrics,
    CriticMetrics,
    PrepareMetrics,
    RolloutMetrics,
    StepMetrics,
    UpdateMetrics,
    ViewMetrics,
    flatten,
)
from polyrl.core.trainer.prepare import UpdateInputs, prepare_update

__all__ = ["ActorMetrics", "CriticMetrics", "Experience", "Generation", "PrepareMetrics", "RolloutCounts",
           "RolloutMetrics", "RunFault", "RunStopped", "StepMetrics", "Trainer", "TrainingAborted", "UpdateInputs",
           "UpdateMetrics", "ViewMetrics", "flatten", "prepare_update", "seed_everything"]
