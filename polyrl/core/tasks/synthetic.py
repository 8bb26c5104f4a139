"""Synthetic verifiable tasks over digit symbols: the tiny recipes' training signal.

Design choice: every prompt carries ``k`` random digits and every answer is a function of them, so
no constant response scores well — a policy must read the prompt. Prompts and answers are
whitespace-separated symbols that a tiny word-level tokenizer maps one-to-one onto tokens:

    copy      : 3 1 4 =          ->  3 1 4
    reverse   : 3 1 4 =          ->  4 1 3
    sort      : 3 1 4 =          ->  1 3 4
    shift     : 3 1 4 =          ->  4 2 5      (each digit + offset, mod n_digits)
    add_mod10 : 3 1 4 + 2 7 5 =  ->  5 8 9      (digit-wise sum, mod n_digits)

Scoring is position-wise partial credit: the number of answer positions the response gets right,
divided by ``max(len(answer), len(response))`` so that padding a response with extra symbols does
not pay. ``exact=True`` gives 1.0 for an exact match and 0.0 otherwise. A uniformly random policy
over the ~16 tokens of a copy-k=3 tokenizer earns about 0.06 (tests/tasks measure it).

Measured learnability on 2 CPU cores (docs/background.md §7): copy k=3 learns in seconds from random init;
reverse/sort k=5 take minutes and depend on the seed; add_mod10 does not learn in minutes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from polyrl.core.errors import BadInputError
from polyrl.core.tasks.example import Example

# Symbols of a task at most: the numbers 0 .. n_digits - 1, one token each (a 4M-entry vocabulary is beyond any
# model polyrl trains; GPT-OSS's and DeepSeek-V3's are 201,088 and 129,280).
MAX_DIGITS = 1 << 22


def _copy(a: list[int], b: list[int], n: int) -> list[int]:
    return list(a)


def _reverse(a: list[int], b: list[int], n: int) -> list[int]:
    return a[::-1]


def _sort(a: list[int], b: list[int], n: int) -> list[int]:
    return sorted(a)


def _add_mod(a: list[int], b: list[int], n: int) -> list[int]:
    return [(x + y) % n for x, y in zip(a, b)]


# name -> (answer function, whether the prompt carries a second operand)
OPERATIONS: dict[str, tuple[Callable[[list[int], list[int], int], list[int]], bool]] = {
    "copy": (_copy, False),
    "reverse": (_reverse, False),
    "sort": (_sort, False),
    "shift": (_add_mod, False),  # the "second operand" is the constant offset, not in the prompt
    "add_mod10": (_add_mod, True),
}


def score_symbols(answer: list[str], response: list[str], *, exact: bool = False) -> float:
    """Position-wise credit in [0, 1]; see the module docstring."""
    if exact:
        return 1.0 if response == answer else 0.0
    if not answer:
        return 1.0 if not response else 0.0
    right = sum(1 for got, want in zip(response, answer) if got == want)
    return right / max(len(answer), len(response))


class SyntheticTask:
    """One operation of the synthetic family.

    Parameters: ``k`` digits per operand (default 3), ``n_digits`` distinct digit symbols (2..MAX_DIGITS,
    default 10; above 10 the symbols are the numbers ``0`` .. ``n_digits - 1``, each one token: a task over a
    real-size vocabulary, e.g. 201,081 symbols fill GPT-OSS's 201,088 ids with the 4 specials and ``copy : =``),
    ``exact`` (exact-match scoring instead of partial credit), ``offset`` (``shift`` only, default 1).
    """

    failure_score = 0.0

    def __init__(self, op: str, *, k: int = 3, n_digits: int = 10, exact: bool = False, offset: int = 1) -> None:
        if op not in OPERATIONS:
            raise BadInputError(f"unknown synthetic task {op!r} (known: {', '.join(OPERATIONS)})")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 64:
            raise BadInputError(f"task {op}: k must be an integer in 1..64, got {k!r}")
        if not isinstance(n_digits, int) or isinstance(n_digits, bool) or not 2 <= n_digits <= MAX_DIGITS:
            raise BadInputError(f"task {op}: n_digits must be an integer in 2..{MAX_DIGITS}, got {n_digits!r}")
        if not isinstance(offset, int) or isinstance(offset, bool):
            raise BadInputError(f"task {op}: offset must be an integer, got {offset!r}")
        if offset % n_digits == 0 and op == "shift":
            raise BadInputError(f"task shift: offset {offset} is a multiple of n_digits (that is copy)")
        self.name = op
        self.k = k
        self.n_digits = n_digits
        self.exact = bool(exact)
        self.offset = offset
        self._fn, self._two_operands = OPERATIONS[op]
        self.max_response_tokens = k + 1  # k answer symbols and the end-of-sequence token
        self._next_group = 0

    def __repr__(self) -> str:
        return f"SyntheticTask({self.name!r}, k={self.k}, n_digits={self.n_digits}, exact={self.exact})"

    def vocab(self) -> list[str]:
        symbols = [*(str(d) for d in range(self.n_digits)), self.name, ":", "="]
        if self._two_operands:
            symbols.append("+")
        return symbols

    def make_example(self, a: list[int], b: list[int] | None = None) -> Example:
        """The example for given operands (digit values); ``sample`` draws them at random."""
        if self._two_operands:
            if b is None or len(b) != len(a):
                raise ValueError(f"{self.name} needs two operands of equal length")
            second = b
            prompt_digits = [*a, "+", *b]
        else:
            second = [self.offset % self.n_digits] * len(a) if self.name == "shift" else []
            prompt_digits = list(a)
        answer = self._fn(a, second, self.n_digits)
        prompt = " ".join([self.name, ":", *(str(s) for s in prompt_digits), "="])
        group_id = self._next_group
        self._next_group += 1
        return Example(prompt=prompt, answer=" ".join(str(d) for d in answer), group_id=group_id,
                       meta={"task": self.name, "k": self.k})

    def sample(self, n: int, rng: random.Random) -> list[Example]:
        examples = []
        for _ in range(n):
            a = [rng.randrange(self.n_digits) for _ in range(self.k)]
            b = [rng.randrange(self.n_digits) for _ in range(self.k)] if self._two_operands else None
            examples.append(self.make_example(a, b))
        return examples

    def state_dict(self) -> dict[str, Any]:
        """The prompt stream's position (the next group id; the prompts come from the trainer's rng)."""
        return {"next_group": self._next_group}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next_group = int(state["next_group"])

    def score(self, example: Example, response: str) -> float:
        return score_symbols(example.answer.split(), response.split(), exact=self.exact)
