"""The RL trainer: the loop (``loop``), experience collection (``experience``), updates (``update``)."""

from polyrl.core.trainer.experience import TrainingAborted
from polyrl.core.trainer.loop import Trainer, fit, seed_everything

__all__ = ["Trainer", "TrainingAborted", "fit", "seed_everything"]
