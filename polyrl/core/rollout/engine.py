"""The rollout engine interface: prompts in, sampled token ids and their sampling log-probs out.

An engine is whatever turns token-id prompts into sampled responses: the in-process ``hf`` engine
(:mod:`polyrl.core.rollout.hf`), or a backend's vLLM engine. The trainer only sees this interface:

    engine.generate(prompts, params, row_seeds=[...]) -> RolloutOutput  # one sampling seed per prompt
    engine.sync_weights(model)       # after each update; a colocated engine sharing the model does nothing

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
