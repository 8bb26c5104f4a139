"""Rollout: sampling responses for the trainer (interface in ``engine``, the in-process ``hf`` engine)."""

from polyrl.core.rollout.engine import RolloutEngine, RolloutOutput, SamplingParams, build_engine, engine_names

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams", "build_engine", "engine_names"]
