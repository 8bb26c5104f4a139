"""Scoring a batch of responses without ever failing the run.

A reward function is user-facing code (plugins, symbolic math): it may raise, return NaN, or hang.
``score_batch`` turns each of those into the task's ``failure_score`` and counts it, so a bad reward
costs one sample, never a run. Tasks that score inline (the synthetic family: microseconds) are
called directly — a slow inline call is counted as a timeout after the fact, since it cannot be
interrupted safely; tasks that declare ``remote_score`` (math) run in time-bounded worker processes, where
a call that kills its worker (a segfaulting verifier, the OOM killer) is one more failure, never the run's.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any, Protocol

from polyrl.core.rewards.pool import CRASHED, OK, TIMEOUT, shared_pool

DEFAULT_TIMEOUT_S = 10.0


class RewardFn(Protocol):
    """A picklable scoring function: ``fn(answer, response) -> float`` (e.g. ``math_reward``)."""

    def __call__(self, answer: str, response: str) -> float: ...


class ScoredTask(Protocol):
    """What ``score_batch`` needs of a task (:class:`polyrl.core.tasks.Task` satisfies it; rewards sit below
    tasks in the layer order, so this module does not import them): ``score(example, response)``, and
    optionally ``failure_score`` and ``remote_score`` (a picklable ``RewardFn`` run in worker processes)."""

    def score(self, example: Any, response: str) -> float: ...


@dataclasses.dataclass(frozen=True)
class ScoreStats:
    """How many rewards of a batch failed: raised, returned a non-finite value or died with their worker
    (``errors``; ``crashed`` counts the deaths among them), or ran past the time bound (``timeouts``). Each
    scored as the task's failure score. ``last_failure``: why the last failed call failed (for a message)."""

    errors: int = 0
    timeouts: int = 0
    crashed: int = 0
    last_failure: str = dataclasses.field(default="", compare=False)


def score_batch(task: ScoredTask, examples: Sequence[Any], responses: Sequence[str], *,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[list[float], ScoreStats]:
    """Score ``responses[i]`` against ``examples[i]``; never raises for a failing reward.

    Returns the scores and the :class:`ScoreStats` of the failures. A call that raises,
    returns a non-finite value, kills its worker, or runs past ``timeout_s`` seconds scores ``task.failure_score``
    (0.0 for synthetic tasks, -1.0 for math).
    """
    if len(examples) != len(responses):
        raise ValueError(f"score_batch: {len(examples)} examples but {len(responses)} responses")
    failure = float(getattr(task, "failure_score", 0.0))
    remote = getattr(task, "remote_score", None)
    scores: list[float] = []
    errors = timeouts = crashed = 0
    last = ""
    if remote is not None:
        results = shared_pool().map(remote, [(ex.answer, r) for ex, r in zip(examples, responses)], timeout_s)
        for status, value in results:
            if status == OK and math.isfinite(value):
                scores.append(value)
                continue
            scores.append(failure)
            last = str(value) if status != OK else "not finite"
            if status == TIMEOUT:
                timeouts += 1
            else:
                errors += 1
                crashed += status == CRASHED
        return scores, ScoreStats(errors, timeouts, crashed, last)

    for example, response in zip(examples, responses):
        start = time.perf_counter()
        try:
            value: Any = float(task.score(example, response))
        except Exception as exc:
            errors += 1
            scores.append(failure)
            last = f"{type(exc).__name__}: {exc}"
            continue
        if time.perf_counter() - start > timeout_s:
            timeouts += 1
            scores.append(failure)
            last = f"took longer than {timeout_s} s"
        elif not math.isfinite(value):
            errors += 1
            scores.append(failure)
            last = "not finite"
        else:
            scores.append(value)
    return scores, ScoreStats(errors, timeouts, crashed, last)
