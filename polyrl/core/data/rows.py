"""Reading prompt/answer rows from ``.jsonl`` and ``.parquet`` files.

Design choice: rows are read eagerly into plain dicts and validated at load time, not lazily per
step, so a bad row 9000 steps in cannot end a long run; the data sets RL recipes use (tens of
thousands of prompts) fit in memory easily. Each returned row is normalised to::

    {"prompt": str,                  # the text, or the last user message of a chat prompt
     "messages": list[dict] | None,  # the chat messages when the prompt field is a message list
     "answer": str,                  # the reference answer (numbers are turned into text)
     "row": int,                     # 1-based position in the file (the line number for .jsonl)
     "fields": dict}                 # the original row, for task-specific extras

``prompt_key`` / ``answer_key`` may be dotted paths into nested objects, e.g.
``answer_key="reward_model.ground_truth"`` for the DAPO-Math-17k layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polyrl.core.errors import BadInputError

SUFFIXES = (".jsonl", ".parquet")
_MISSING = object()


def lookup(row: dict[str, Any], key: str) -> Any:
    """``row[key]`` where ``key`` may be a dotted path (``"a.b"`` is ``row["a"]["b"]``); a miss returns ``_MISSING``."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    rows = []
    try:
        with path.open("r", encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((line_no, json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise BadInputError(f"data file {path}: line {line_no}: not valid JSON ({exc.msg})") from None
    except UnicodeDecodeError:
        raise BadInputError(f"data file {path}: not UTF-8 text") from None
    except OSError as exc:
        raise BadInputError(f"data file {path}: cannot read ({exc.strerror or exc})") from None
    return rows


def _read_parquet(path: Path) -> list[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BadInputError(f"data file {path}: reading parquet needs pyarrow (pip install 'polyrl[data]')") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError subclasses for corrupt files
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadInputError(f"data file {path}: not a readable parquet file ({reason})") from None
    return list(enumerate(table.to_pylist(), start=1))


def _prompt_text(path: Path, where: str, key: str, value: Any) -> tuple[str, list[dict] | None]:
    if isinstance(value, str):
        if not value.strip():
            raise BadInputError(f"data file {path}: {where}: field {key!r} is empty")
        return value, None
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        for i, message in enumerate(value):
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise BadInputError(
                    f"data file {path}: {where}: field {key!r} message {i} needs string 'role' and 'content'")
        users = [m["content"] for m in value if m["role"] == "user"]
        if not users:
            raise BadInputError(f"data file {path}: {where}: field {key!r} has no user message")
        return users[-1], [{"role": m["role"], "content": m["content"]} for m in value]
    raise BadInputError(
        f"data file {path}: {where}: field {key!r} must be a string or a list of chat messages, "
        f"got {type(value).__name__}")


def _answer_text(path: Path, where: str, key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise BadInputError(f"data file {path}: {where}: field {key!r} must be a string or a number, "
                            f"got {type(value).__name__}")
    text = str(value).strip()
    if not text:
        raise BadInputError(f"data file {path}: {where}: field {key!r} is empty")
    return text


def load_rows(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer") -> list[dict[str, Any]]:
    """All rows of a ``.jsonl`` or ``.parquet`` file, validated and normalised (see module docstring).

    Raises ``BadInputError`` naming the file (and the row and field) when the file is missing, has
    another suffix, cannot be parsed, is empty, or a row lacks ``prompt_key`` / ``answer_key``.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise BadInputError(f"data file {path}: not found")
    if not path.is_file():
        raise BadInputError(f"data file {path}: not a file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        raw, unit = _read_jsonl(path), "line"
    elif suffix == ".parquet":
        raw, unit = _read_parquet(path), "row"
    else:
        raise BadInputError(f"data file {path}: unsupported suffix {suffix or '(none)'!r} (use {' or '.join(SUFFIXES)})")
    if not raw:
        raise BadInputError(f"data file {path}: no rows")

    rows = []
    for number, record in raw:
        where = f"{unit} {number}"
        if not isinstance(record, dict):
            raise BadInputError(f"data file {path}: {where}: expected a JSON object, got {type(record).__name__}")
        prompt_value = lookup(record, prompt_key)
        if prompt_value is _MISSING or prompt_value is None:
            raise BadInputError(f"data file {path}: {where}: missing field {prompt_key!r}")
        answer_value = lookup(record, answer_key)
        if answer_value is _MISSING or answer_value is None:
            raise BadInputError(f"data file {path}: {where}: missing field {answer_key!r}")
        prompt, messages = _prompt_text(path, where, prompt_key, prompt_value)
        answer = _answer_text(path, where, answer_key, answer_value)
        rows.append({"prompt": prompt, "messages": messages, "answer": answer, "row": number, "fields": record})
    return rows
