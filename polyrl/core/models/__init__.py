"""Model presets and construction: ``build_model(name_or_path, ...)`` and ``model_config(name, **overrides)``."""

from polyrl.core.models.build import build_model
from polyrl.core.models.presets import PRESETS, model_config, preset_names

__all__ = ["PRESETS", "build_model", "model_config", "preset_names"]
