"""DAPO-style answer extraction and the +1 / -1 math reward."""

from __future__ import annotations

import pytest

from polyrl.core.rewards.math import TAIL_CHARS, extract_answer, math_reward, verify_answer


@pytest.mark.parametrize(
    "response, expected",
    [
        ("so the total is 12.\nAnswer: 12", "12"),
        ("Answer: 3\nwait, no.\nAnswer: $\\frac{1}{2}$.", "\\frac{1}{2}"),
        ("answer : 7", "7"),
        ("thus \\boxed{5} and finally \\boxed{\\frac{a}{b+1}}", "\\frac{a}{b+1}"),
        ("Answer: \\boxed{9}", "9"),
        ("\\boxed 8", "8"),
        ("\\boxed{7} then \\boxed{unclosed", "7"),
        ("no final answer here", None),
        ("Answer:   \n", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_only_the_tail_counts():
    early = "Answer: 41\n" + "x" * TAIL_CHARS
    assert extract_answer(early) is None
    assert extract_answer("Answer: 41\n" + "x" * (TAIL_CHARS - 20)) == "41"


@pytest.mark.parametrize(
    "reference, candidate, ok",
    [
        ("42", "42", True),
        ("\\frac{1}{2}", "0.5", True),
        ("\\frac{1}{2}", "\\dfrac{1}{2}", True),
        ("x+1", "1+x", True),
        ("\\sqrt{2}", "\\frac{2}{\\sqrt{2}}", True),
        ("5", "6", False),
        ("5", "five-ish", False),
    ],
)
def test_verify_answer(reference, candidate, ok):
    assert verify_answer(reference, candidate) is ok


def test_math_reward_is_plus_or_minus_one():
    assert math_reward("42", "6 times 7.\nAnswer: 42") == 1.0
    assert math_reward("42", "6 times 7 is \\boxed{42}") == 1.0
    assert math_reward("42", "Answer: 41") == -1.0
    assert math_reward("42", "I don't know") == -1.0
