"""The rollout engine interface: prompts in, sampled token ids and their sampling log-probs out.

An engine is whatever turns token-id prompts into sampled responses: the in-process ``hf`` engine
(:mod:`polyrl.core.rollout.hf`), or a backend's vLLM engine. The trainer only sees this interface:

    engine.generate(prompts, params, row_seeds=[...]) -> RolloutOutput  # one sampling seed per prompt
    engine.sleep() / engine.wake_up()  # around training: an engine holding its own memory frees it meanwhile
    engine.sync_weights(model)       # after each update; a colocated engine sharing the model does nothing

An engine that holds its own copy of the weights (vLLM) also implements :class:`VerifiedEngine`: the trainer
checks every sync on a probe batch, in prefill (``score``) and, where the engine has it, in decode
(``decode_probe_diff``), and stops the run when the engine does not reproduce the trainer
(:mod:`polyrl.core.trainer.sync`): such an engine is built once and never rebuilt in-process. The ``hf`` engine
*is* the trainer's model, so there is nothing to check beyond ``rollout/logprob_diff``.

An engine factory may carry a ``routes_refusal(backend) -> str`` attribute: why that engine cannot return the experts
it routed each token to (``rollout.routing_replay=r3``; "" when it can); a factory without it cannot.

An engine factory may carry a ``refusal(model_config, backend) -> str`` attribute: why that engine cannot serve
such a model on that backend ("" when it can). ``rollout.engine: auto`` asks it before choosing, so that it never
picks an engine that would refuse the model; an explicit choice is refused before the run starts.

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
    # Routing replay (rollout.routing_replay=r3), from an engine built with ``return_routes=True``: per prompt, the
    # experts each token the engine ran was routed to, [P + R - 1, L, k] int (P prompt tokens, R response tokens:
    # the last sampled token is never run; L the MoE layers in order, k experts per token). None otherwise.
    routes: list[Any] | None = None


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
    """An engine with its own copy of the weights: the trainer verifies each sync through ``score`` (and, where
    the engine has it, ``decode_probe_diff(trainer_score) -> float``: the largest difference over tokens it
    samples at decode time). 0.2.0's ``rebuild`` is no longer called: a failed check stops the run."""

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probs at temperature 1 of ``sequences[i][t]`` given ``sequences[i][:t]``, for t >= 1 (so one
        entry fewer than the sequence), computed by the engine's own forward on its current weights."""
        ...


def is_verified(engine: Any) -> bool:
    """Does ``engine`` hold its own weights (and so must have each sync checked)?"""
    return callable(getattr(engine, "score", None))


def resolve_engine(requested: str, backend: Any, model_config: Any = None) -> str:
    """The engine a recipe's ``rollout.engine`` names on ``backend`` (:func:`choose_engine` without the why)."""
    return choose_engine(requested, backend, model_config)[0]


def choose_engine(requested: str, backend: Any, model_config: Any = None) -> tuple[str, str]:
    """The engine a recipe's ``rollout.engine`` names on ``backend``, and why (one line for the run log):
    ``auto`` is the backend's first engine (``Backend.rollout_engines`` is in order of preference) that is
    registered, ready here (``Backend.rollout_engine_problem``) and serves the model (its factory's ``refusal``,
    given ``model_config``); an explicit name must be registered, ready if the backend lists it, and serve the
    model. Refusals are bad input (one line, before anything is built)."""
    from polyrl.core.errors import BadInputError
    from polyrl.core.plugins import get_registry

    registered = get_registry().rollout_engines
    declared = tuple(getattr(backend, "rollout_engines", ("hf",)))
    kind = str(getattr(model_config, "model_type", "") or "this model")

    def refusal(name: str) -> str:
        refuse = getattr(registered[name], "refusal", None)
        return refuse(model_config, backend) if callable(refuse) and model_config is not None else ""

    if requested == "auto":
        why = []
        for name in declared:
            problem = ("not registered" if name not in registered else backend.rollout_engine_problem(name)
                       or refusal(name))
            if not problem:
                skipped = f" ({'; '.join(why)})" if why else ""
                return name, f"rollout engine {name} (auto: the first of {', '.join(declared)} that serves {kind} on {backend.name}{skipped})"
            why.append(f"{name}: {problem}")
        raise BadInputError(f"rollout.engine=auto: no engine of backend {backend.name!r} can run here ({'; '.join(why)})")
    if requested not in registered:
        raise BadInputError(f"rollout.engine: unknown rollout engine {requested!r} "
                            f"(known: {', '.join(engine_names()) or '(none)'})")
    # An engine the backend does not list is allowed when named (a plugin's engine may run anywhere); one it lists
    # must be ready here.
    problem = (backend.rollout_engine_problem(requested) if requested in declared else "") or refusal(requested)
    if problem:
        raise BadInputError(f"rollout.engine: engine {requested!r} cannot run on backend {backend.name!r}: {problem}")
    return requested, f"rollout engine {requested} (rollout.engine={requested})"


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
