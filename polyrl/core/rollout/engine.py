"""The rollout engine interface: prompts in, sampled token ids and their sampling log-probs out.

An engine is whatever turns token-id prompts into sampled responses: the in-process ``hf`` engine
(:mod:`polyrl.core.rollout.hf`), or a backend's vLLM engine. The trainer only sees this interface:

    engine.generate(prompts, params, row_seeds=[...]) -> RolloutOutput  # one sampling seed per prompt
    engine.sleep() / engine.wake_up()  # around training: an engine holding its own memory frees it meanwhile
    engine.sync_weights(model)       # after each update; a colocated engine sharing the model does nothing

An engine that holds its own copy of the weights (vLLM) also implements :class:`VerifiedEngine`: the trainer
checks every sync on a probe batch (:mod:`polyrl.core.trainer.sync`) and asks the engine to ``rebuild`` from a
fresh export when the check fails. The ``hf`` engine *is* the trainer's model, so there is nothing to check
beyond ``rollout/logprob_diff``.

Log-prob convention: ``logprobs[i][t]`` is log softmax(logits / temperature) at the sampled token, taken
*before* top-p / top-k truncation — exactly what the trainer recomputes, so ``rollout/logprob_diff``
measures numerical drift between engine and trainer, not a difference of definitions.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_tokens: int = 16
    # Generation of a sequence stops after any of these (the stop token is part of the response).
    stop_token_ids: tuple[int, ...] = ()
    # Sequences generated together; 0 = all at once.
    micro_batch_size: int = 0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclasses.dataclass
class RolloutOutput:
    """One entry per prompt, in order. ``response_ids[i]`` ends with its stop token when one was hit
    (``finish_reasons[i] == "stop"``) and is ``max_tokens`` long otherwise (``"length"``)."""

    response_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]


class RolloutEngine(Protocol):
    name: str

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, row_seeds: list[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> RolloutOutput:
        """``row_seeds``: one sampling seed per prompt (the row's tokens depend on it alone); without them the
        engine draws seeds from ``generator`` (a CPU generator)."""
        ...

    def sync_weights(self, model: Any) -> None: ...

    def sleep(self) -> None:
        """Free what generation holds (KV cache, weights offloaded) while the trainer trains; no-op if nothing."""
        ...

    def wake_up(self) -> None:
        """Undo ``sleep`` before the next sync and generation."""
        ...


class VerifiedEngine(RolloutEngine, Protocol):
    """An engine with its own copy of the weights: the trainer verifies each sync through these two methods."""

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probs at temperature 1 of ``sequences[i][t]`` given ``sequences[i][:t]``, for t >= 1 (so one
        entry fewer than the sequence), computed by the engine's own forward on its current weights."""
        ...

    def rebuild(self, model: Any) -> None:
        """Recreate the engine from a full export of ``model``'s weights (the repair of a failed sync)."""
        ...


def is_verified(engine: Any) -> bool:
    """Does ``engine`` hold its own weights (and so must have each sync checked)?"""
    return callable(getattr(engine, "score", None)) and callable(getattr(engine, "rebuild", None))


def resolve_engine(requested: str, backend: Any) -> str:
    """The engine a recipe's ``rollout.engine`` names on ``backend``: ``auto`` is the backend's first engine
    (``Backend.rollout_engines`` is in order of preference) that is registered and ready here
    (``Backend.rollout_engine_problem``); an explicit name must be registered, and ready if the backend lists it."""
    from polyrl.core.errors import BadInputError
    from polyrl.core.plugins import get_registry

    registered = get_registry().rollout_engines
    declared = tuple(getattr(backend, "rollout_engines", ("hf",)))
    if requested == "auto":
        why = []
        for name in declared:
            problem = "not registered" if name not in registered else backend.rollout_engine_problem(name)
            if not problem:
                return name
            why.append(f"{name}: {problem}")
        raise BadInputError(f"rollout.engine=auto: no engine of backend {backend.name!r} can run here ({'; '.join(why)})")
    if requested not in registered:
        raise BadInputError(f"rollout.engine: unknown rollout engine {requested!r} "
                            f"(known: {', '.join(engine_names()) or '(none)'})")
    # An engine the backend does not list is allowed when named (a plugin's engine may run anywhere); one it lists
    # must be ready here.
    problem = backend.rollout_engine_problem(requested) if requested in declared else ""
    if problem:
        raise BadInputError(f"rollout.engine: engine {requested!r} cannot run on backend {backend.name!r}: {problem}")
    return requested


def engine_names() -> list[str]:
    """Rollout engines registered through the ``polyrl_register_rollout_engines`` hook (polyrl's own ``hf``
    comes from the cpu plugin, a vLLM engine from its backend's plugin)."""
    from polyrl.core.plugins import get_registry

    return sorted(get_registry().rollout_engines)


def build_engine(name: str, model: Any, *, pad_token_id: int, **kwargs: Any) -> RolloutEngine:
    """The engine called ``name`` over ``model`` (colocated: it shares the trainer's weights), built by the
    factory its plugin registered: ``factory(model, pad_token_id=..., **kwargs)``."""
    from polyrl.core.errors import BadInputError
    from polyrl.core.plugins import get_registry

    factories = get_registry().rollout_engines
    if name not in factories:
        raise BadInputError(f"unknown rollout engine {name!r} (known: {', '.join(engine_names()) or '(none)'})")
    return factories[name](model, pad_token_id=pad_token_id, **kwargs)
