"""``Example``, what every task samples: its own module so that the built-in tasks (``math``, ``synthetic``),
which the package loads on first lookup, import it without importing the package that loads them."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Example:
    """One prompt and its reference answer.

    ``prompt``: for synthetic tasks, whitespace-separated symbols that are all in ``task.vocab()``
    (e.g. ``"copy : 3 1 4 ="``); for text tasks, the prompt text. ``group_id`` names the prompt: the
    trainer samples several responses per example and they share it (GRPO/DAPO groups). ``meta`` holds
    task-specific extras (e.g. the chat messages and source row of a math example).
    """

    prompt: str
    answer: str
    group_id: int | str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
