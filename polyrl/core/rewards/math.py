"""Math reward (DAPO style): extract the final answer, verify it against the reference, +1 / -1.

Extraction looks only at the last ``TAIL_CHARS`` (300) characters of the response, as DAPO does: a
long derivation cannot earn credit for a number it mentioned early. Inside that tail the last
``Answer: ...`` line wins; otherwise the content of the last ``\\boxed{...}`` (braces balanced); no
answer scores -1. The extracted answer is accepted when it equals the reference after light
normalisation (fast path, no sympy), or when math-verify finds them mathematically equal.

``math_reward`` has no time bound of its own: math-verify's signal timeouts only work on a main
thread, so they are disabled here and :func:`polyrl.core.rewards.score_batch` bounds the call from
outside (worker processes with a deadline, see :mod:`polyrl.core.rewards.pool`).
"""

from __future__ import annotations

import re

TAIL_CHARS = 300
CORRECT, INCORRECT = 1.0, -1.0

_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]*)", re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")


def _boxed_contents(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``) in ``text``."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                if text[i] == "{":
                    depth += 1
                elif text[i] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[start + 1 : i].strip()
            continue  # unbalanced (cut off): try an earlier box
        bare = re.match(r"[^\s$]+", text[start:])  # "\boxed 5"
        if bare:
            return bare.group(0)
    return None


def extract_answer(response: str) -> str | None:
    """The final answer of a response, or None. See the module docstring for the rules."""
    tail = response[-TAIL_CHARS:]
    lines = _ANSWER_LINE.findall(tail)
    if lines:
        answer = lines[-1].strip()
        boxed = _boxed_contents(answer)
        if boxed is not None:
            answer = boxed
        answer = re.sub(r"^[\s$]+|[\s$.]+$", "", answer)  # "$x$." -> "x"
        return answer or None
    return _boxed_contents(tail)


def normalize(answer: str) -> str:
    """Light, safe normalisation for the string fast path: spacing, ``$``, ``\\left``/``\\right``, a final period."""
    text = answer.strip().strip("$").rstrip(".")
    text = text.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    text = re.sub(r"\\text\{\s*([^{}]*?)\s*\}", r"\1", text)
    text = text.replace("dfrac", "frac").replace("tfrac", "frac")
    return re.sub(r"\s+", "", text)


def verify_answer(reference: str, candidate: str) -> bool:
    """True when ``candidate`` equals ``reference`` (string fast path, then math-verify). No time bound."""
    if normalize(reference) == normalize(candidate):
        return True
    from math_verify import parse, verify

    gold = parse(f"\\boxed{{{reference.strip().strip('$')}}}", parsing_timeout=None)
    pred = parse(f"\\boxed{{{candidate}}}", parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def math_reward(answer: str, response: str) -> float:
    """+1 when the response's final answer matches ``answer``, else -1 (a ``RewardFn``)."""
    candidate = extract_answer(response)
    if candidate is None:
        return INCORRECT
    return CORRECT if verify_answer(answer, candidate) else INCORRECT
