"""The engine-options part of a backend: which rollout engines can run on it and with what settings.

The engines themselves are registered through ``polyrl_register_rollout_engines`` and declared in order of
preference by the backend's ``rollout_engines`` (``rollout.engine: auto`` takes the first that is ready); this
part only answers for them, without importing any engine's package.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polyrl.core.plugins.kernels import one_line
from polyrl.core.plugins.part import BackendPart


class EngineOptions(BackendPart):
    """Reached as ``backend.engines``."""

    methods: ClassVar[tuple[str, ...]] = ("rollout_engine_problem", "rollout_engine_options")

    def rollout_engine_problem(self, engine: str) -> str:
        """Why ``engine`` cannot run here ("" when it can): e.g. its package is missing. Must not import it."""
        return ""

    def rollout_engine_options(self, engine: str) -> dict[str, Any]:
        """This backend's settings for ``engine`` (the vLLM engine reads ``polyrl.backends.vllm_engine.VllmSettings``
        fields from it: environment, memory utilisation, sleep level, in-place sync); {} for the defaults."""
        return {}

    def problem(self, engine: str) -> str:
        """``rollout_engine_problem``, isolated: a plugin's bug is reported as the problem, not raised."""
        try:
            return str(self.rollout_engine_problem(engine))
        except Exception as exc:
            return f"rollout_engine_problem() raised {one_line(exc)}"
