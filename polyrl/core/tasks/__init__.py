"""Tasks: where prompts come from and how a response is scored.

A task is a small object (the ``Task`` protocol below) that samples ``Example`` s with a caller-owned
``random.Random`` — so one seed fixes the prompt stream — and scores one decoded response. Two kinds
ship with polyrl:

- the synthetic family (:mod:`polyrl.core.tasks.synthetic`): ``copy``, ``reverse``, ``sort``, ``shift``
  and ``add_mod10`` over digit symbols, answerable only by reading the prompt, scored position-wise
  in [0, 1]; the tiny recipes train on them from random init;
- ``math`` (:mod:`polyrl.core.tasks.math`): rows of a parquet/jsonl file (schema in docs/data.md),
  scored +1 / -1 by :mod:`polyrl.core.rewards.math`.

Plugins add tasks through the ``polyrl_register_tasks`` hook: ``register("name", factory)`` where
``factory(**params)`` returns a ``Task``. ``get_task`` looks up built-ins first, then plugins.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from polyrl.core.errors import BadInputError
from polyrl.core.tasks.example import Example


@runtime_checkable
class Task(Protocol):
    """What the trainer needs from a task.

    ``score`` returns a float in [0, 1] for the synthetic tasks; the math task uses the DAPO scale
    {-1, +1}. ``failure_score`` is what a response scores when its reward raises or times out (0.0,
    resp. -1.0). ``max_response_tokens`` is the default generation budget (a recipe may override it).

    Optional: ``state_dict()`` / ``load_state_dict(state)`` for a task that keeps a position in its prompt
    stream (the built-in tasks: the next group id, the math task's epoch order): saved in checkpoints.
    A task whose scoring may be slow or hang (math) sets ``remote_score`` to a picklable
    top-level function ``(answer, response) -> float``; :func:`polyrl.core.rewards.score_batch` then
    runs it in worker processes under a hard time bound instead of calling ``score`` inline.
    """

    name: str
    max_response_tokens: int
    failure_score: float

    def vocab(self) -> list[str]:
        """Symbols the tokenizer must hold as single tokens; [] for free-text tasks."""
        ...

    def sample(self, n: int, rng: Any) -> list[Example]:
        """``n`` examples drawn with ``rng`` (a ``random.Random``); same rng state, same examples."""
        ...

    def score(self, example: Example, response: str) -> float:
        """Reward of one decoded response (text up to, not including, the end-of-sequence token)."""
        ...


def builtin_tasks() -> dict[str, Callable[..., Task]]:
    """Name -> factory for the tasks that ship with polyrl."""
    from polyrl.core.tasks.math import MathTask
    from polyrl.core.tasks.synthetic import OPERATIONS, SyntheticTask

    factories: dict[str, Callable[..., Task]] = {op: functools.partial(SyntheticTask, op) for op in OPERATIONS}
    factories["math"] = MathTask
    return factories


def available_tasks() -> dict[str, Callable[..., Task]]:
    """Built-ins plus plugin-registered tasks; a plugin cannot shadow a built-in name."""
    from polyrl.core.plugins import get_registry

    factories = dict(get_registry().tasks)
    factories.update(builtin_tasks())
    return factories


def get_task(name: str, **params: Any) -> Task:
    """Build the task called ``name`` with ``params`` (e.g. ``get_task("copy", k=3)``).

    Raises ``BadInputError`` for an unknown name or parameters the task refuses, so a recipe typo
    exits 2 with one line.
    """
    factories = builtin_tasks()
    factory = factories.get(name)
    if factory is None:
        factory = available_tasks().get(name)
    if factory is None:
        known = ", ".join(sorted(available_tasks()))
        raise BadInputError(f"unknown task {name!r} (known: {known})")
    try:  # check the parameters against the factory's signature: a recipe typo, not a bug inside it
        inspect.signature(factory).bind(**params)
    except TypeError as exc:
        raise BadInputError(f"task {name!r}: {exc}") from None
    except ValueError:  # no introspectable signature (a builtin): let the call decide
        pass
    return factory(**params)


__all__ = ["Example", "Task", "available_tasks", "builtin_tasks", "get_task"]
