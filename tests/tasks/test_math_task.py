"""The math task: built from a data file, bad input is BadInputError, epochs are seeded."""

from __future__ import annotations

import json
import random

import pytest

from polyrl.core.errors import BadInputError
from polyrl.core.tasks import get_task


def write_rows(path, n):
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(n)))
    return path


def test_bad_inputs_are_bad_input_errors(tmp_path):
    with pytest.raises(BadInputError, match="needs a data file"):
        get_task("math")
    with pytest.raises(BadInputError, match="not found"):
        get_task("math", path=str(tmp_path / "missing.jsonl"))
    (tmp_path / "d.jsonl").write_text('{"prompt": "q"}\n')
    with pytest.raises(BadInputError, match="line 1: missing field 'answer'"):
        get_task("math", path=str(tmp_path / "d.jsonl"))
    with pytest.raises(BadInputError, match="unexpected keyword argument 'pth'"):
        get_task("math", pth="x")


def test_epochs_cover_every_row_and_are_seeded(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", 7)
    task = get_task("math", path=str(path), max_response_tokens=64)
    assert task.max_response_tokens == 64 and task.failure_score == -1.0
    examples = task.sample(14, random.Random(3))
    assert sorted(e.meta["row"] for e in examples[:7]) == list(range(1, 8))
    assert sorted(e.meta["row"] for e in examples[7:]) == list(range(1, 8))
    assert all(e.prompt == f"q{int(e.answer)}" for e in examples)
    again = get_task("math", path=str(path)).sample(14, random.Random(3))
    assert [e.prompt for e in again] == [e.prompt for e in examples]
    assert task.score(examples[0], f"Answer: {examples[0].answer}") == 1.0
