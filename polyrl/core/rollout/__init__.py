"""Rollout: sampling responses for the trainer (interface in ``engine``, the in-process ``hf`` engine)."""

from polyrl.core.rollout.engine import (
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    VerifiedEngine,
    build_engine,
    choose_engine,
    engine_names,
    is_verified,
    resolve_engine,
)

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams", "VerifiedEngine", "build_engine", "choose_engine", "engine_names",
           "is_verified", "resolve_engine"]
