"""The ``math`` task: prompts and reference answers from a data file, DAPO reward (+1 / -1).

Rows come from :func:`polyrl.core.data.load_rows` (schema in docs/data.md) and are read once, at
construction, so a bad file fails before training starts. Sampling walks the rows in epochs: a
fresh permutation drawn from the caller's rng each time the previous one is used up, so every row is
seen once per epoch and a seed fixes the order.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from polyrl.core.data import load_rows
from polyrl.core.errors import BadInputError
from polyrl.core.rewards.math import INCORRECT, math_reward
from polyrl.core.tasks.example import Example


class MathTask:
    """Math word problems with verifiable answers (e.g. DAPO-Math-17k converted to the documented schema)."""

    name = "math"
    failure_score = INCORRECT
    # Picklable, so score_batch runs it in time-bounded worker processes (symbolic checks can hang).
    remote_score = staticmethod(math_reward)

    def __init__(self, path: str | Path | None = None, *, prompt_key: str = "prompt", answer_key: str = "answer",
                 max_response_tokens: int = 1024) -> None:
        if path is None:
            raise BadInputError("task math: needs a data file (data.path in the recipe)")
        if not isinstance(max_response_tokens, int) or max_response_tokens < 1:
            raise BadInputError(f"task math: max_response_tokens must be a positive integer, got {max_response_tokens!r}")
        self.path = Path(path)
        self.rows = load_rows(self.path, prompt_key=prompt_key, answer_key=answer_key)
        self.max_response_tokens = max_response_tokens
        self._order: list[int] = []
        self._cursor = 0
        self._next_group = 0

    def __repr__(self) -> str:
        return f"MathTask({str(self.path)!r}, rows={len(self.rows)})"

    def vocab(self) -> list[str]:
        return []  # free text: the model's own tokenizer

    def sample(self, n: int, rng: random.Random) -> list[Example]:
        examples = []
        for _ in range(n):
            if self._cursor >= len(self._order):
                self._order = list(range(len(self.rows)))
                rng.shuffle(self._order)
                self._cursor = 0
            row = self.rows[self._order[self._cursor]]
            self._cursor += 1
            examples.append(Example(prompt=row["prompt"], answer=row["answer"], group_id=self._next_group,
                                    meta={"row": row["row"], "messages": row["messages"]}))
            self._next_group += 1
        return examples

    def state_dict(self) -> dict[str, Any]:
        """The prompt stream's position (epoch order, cursor, next group id): saved with the trainer's state."""
        return {"order": list(self._order), "cursor": self._cursor, "next_group": self._next_group}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._order, self._cursor, self._next_group = list(state["order"]), int(state["cursor"]), int(state["next_group"])

    def score(self, example: Example, response: str) -> float:
        """+1 / -1, in-process and without a time bound (score_batch bounds it; see rewards.math)."""
        return math_reward(example.answer, response)
