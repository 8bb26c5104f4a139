"""The synthetic task family: answers depend on the prompt, scoring, seeding, and the random-policy bar."""

from __future__ import annotations

import random

import pytest

from polyrl.core.errors import BadInputError
from polyrl.core.tasks import Example, Task, get_task
from polyrl.core.tasks.synthetic import OPERATIONS, SyntheticTask, score_symbols

SPECIALS = ["<eos>", "<pad>", "<bos>"]  # what a tiny tokenizer adds to the task's symbols


def random_policy_response(vocab: list[str], max_tokens: int, rng: random.Random) -> str:
    """A uniformly random policy over the tokenizer (task symbols + specials), decoded up to <eos>."""
    tokens = [*vocab, *SPECIALS]
    out = []
    for _ in range(max_tokens):
        tok = rng.choice(tokens)
        if tok == "<eos>":
            break
        if tok not in SPECIALS:  # skip_special_tokens
            out.append(tok)
    return " ".join(out)


def test_examples_are_what_the_docstring_says():
    a = [3, 1, 4]
    assert get_task("copy").make_example(a).prompt == "copy : 3 1 4 ="
    assert get_task("copy").make_example(a).answer == "3 1 4"
    assert get_task("reverse").make_example(a).answer == "4 1 3"
    assert get_task("sort").make_example(a).answer == "1 3 4"
    assert get_task("shift").make_example(a).answer == "4 2 5"
    ex = get_task("add_mod10").make_example(a, [2, 7, 5])
    assert (ex.prompt, ex.answer) == ("add_mod10 : 3 1 4 + 2 7 5 =", "5 8 9")


@pytest.mark.parametrize("op", list(OPERATIONS))
def test_prompt_symbols_are_in_vocab_and_answer_depends_on_prompt(op):
    task = get_task(op, k=4)
    assert isinstance(task, Task)
    examples = task.sample(200, random.Random(1))
    vocab = set(task.vocab())
    for ex in examples:
        assert set(ex.prompt.split()) <= vocab
        assert set(ex.answer.split()) <= vocab
        assert len(ex.answer.split()) == 4
        assert task.score(ex, ex.answer) == 1.0
    # Not a constant task: many distinct answers, and the most common one is rare.
    answers = [ex.answer for ex in examples]
    assert len(set(answers)) > 50
    assert max(answers.count(a) for a in set(answers)) / len(answers) < 0.1
    # group ids are unique per example
    assert len({ex.group_id for ex in examples}) == len(examples)
    assert task.max_response_tokens == 5


def test_same_seed_same_examples_different_seed_different():
    def prompts(seed):
        return [e.prompt for e in get_task("copy").sample(20, random.Random(seed))]

    assert prompts(0) == prompts(0)
    assert prompts(0) != prompts(1)


def test_partial_credit_and_exact_match():
    ex = Example(prompt="copy : 3 1 4 =", answer="3 1 4", group_id=0)
    copy = get_task("copy")
    assert copy.score(ex, "3 1 4") == 1.0
    assert copy.score(ex, "3 1 5") == pytest.approx(2 / 3)
    assert copy.score(ex, "3") == pytest.approx(1 / 3)
    assert copy.score(ex, "") == 0.0
    assert copy.score(ex, "3 1 4 4 4 4") == pytest.approx(3 / 6)  # extra symbols do not pay
    assert copy.score(ex, "  3\t1 4\n") == 1.0  # whitespace-split
    exact = get_task("copy", exact=True)
    assert exact.score(ex, "3 1 5") == 0.0
    assert exact.score(ex, "3 1 4") == 1.0
    assert score_symbols([], []) == 1.0


@pytest.mark.parametrize("op", ["copy", "reverse", "sort"])
def test_random_policy_earns_at_most_0_15(op):
    task = get_task(op, k=3)
    rng = random.Random(1234)
    examples = task.sample(2000, rng)
    assert len(task.vocab()) + len(SPECIALS) == 16  # the ~16-token tokenizer of the tiny recipes
    rewards = [task.score(ex, random_policy_response(task.vocab(), task.max_response_tokens, rng)) for ex in examples]
    mean = sum(rewards) / len(rewards)
    assert 0.0 < mean <= 0.15, mean  # earns something (a learning signal), but not much


def test_constant_policy_earns_little_on_copy():
    task = get_task("copy", k=3)
    examples = task.sample(2000, random.Random(5))
    best = max(sum(task.score(ex, const) for ex in examples) / len(examples)
               for const in ["0 0 0", "1 2 3", "5 5 5"])
    assert best < 0.15


def test_bad_parameters_are_bad_input():
    with pytest.raises(BadInputError, match="unknown task 'copyy'"):
        get_task("copyy")
    with pytest.raises(BadInputError, match="k must be"):
        get_task("copy", k=0)
    with pytest.raises(BadInputError, match="n_digits"):
        get_task("sort", n_digits=1)
    with pytest.raises(BadInputError, match="n_digits"):
        get_task("sort", n_digits=(1 << 22) + 1)
    with pytest.raises(BadInputError, match="task 'copy'"):
        get_task("copy", kk=3)
    with pytest.raises(BadInputError):
        SyntheticTask("nope")


def test_plugin_registered_task_is_found(monkeypatch):
    from polyrl.core import plugins

    class Constant:
        name = "constant"
        max_response_tokens = 2
        failure_score = 0.0

        def __init__(self, word="yes"):
            self.word = word

        def vocab(self):
            return [self.word]

        def sample(self, n, rng):
            return [Example(prompt="say", answer=self.word, group_id=i) for i in range(n)]

        def score(self, example, response):
            return float(response.strip() == example.answer)

    registry = plugins.get_registry()
    monkeypatch.setitem(registry.tasks, "constant", Constant)
    task = get_task("constant", word="ok")
    assert task.vocab() == ["ok"]
    # a plugin cannot shadow a built-in
    monkeypatch.setitem(registry.tasks, "copy", Constant)
    assert isinstance(get_task("copy"), SyntheticTask)


@pytest.mark.parametrize("recipe", ["gpt_oss_dapo_tiny", "deepseek_ppo_tiny"])
def test_the_tiny_recipes_task_is_a_real_one(recipe):
    """Issue 5's bar on the task the tiny recipes actually train on: a uniformly random policy (over the
    recipe's tokenizer) earns at most 0.15, and the answer copies >= 3 prompt tokens (it changes with the
    prompt). A policy that already knows the format and guesses digits earns 1/n_digits (0.2 with the
    recipes' 5 symbols): measured here so the number is on record, not held to the bar."""
    from polyrl.core.config import load_config

    cfg = load_config(f"recipes/{recipe}.yaml")
    task = get_task(cfg.data.task, **cfg.data.task_params)
    rng = random.Random(7)
    examples = task.sample(2000, rng)
    uniform = [task.score(ex, random_policy_response(task.vocab(), task.max_response_tokens, rng)) for ex in examples]
    assert 0.0 < sum(uniform) / len(uniform) <= 0.15
    digits = sorted({s for ex in examples for s in ex.answer.split()})
    guesses = [task.score(ex, " ".join(rng.choice(digits) for _ in ex.answer.split())) for ex in examples]
    assert abs(sum(guesses) / len(guesses) - 1 / len(digits)) < 0.03
    assert all(len(ex.answer.split()) >= 3 for ex in examples)
    assert len({ex.answer for ex in examples}) > 100  # the answer depends on the prompt
    assert all(ex.answer.split() == ex.prompt.split()[2:-1] for ex in examples[:50])  # copy of the prompt's digits


def test_a_task_over_a_real_size_vocabulary_has_one_token_per_symbol():
    """n_digits above 10: the symbols are the numbers 0 .. n-1, each one token of the task's tokenizer; 201,081 of
    them fill GPT-OSS's 201,088 ids with the 4 specials and `copy : =`."""
    from polyrl.core.models.tokenizer import build_tiny_tokenizer

    task = get_task("copy", k=4, n_digits=201_081)
    tok = build_tiny_tokenizer(task.vocab())
    assert len(tok) == 201_088
    ex = task.make_example([201_080, 7, 10, 123_456])
    assert ex.prompt == "copy : 201080 7 10 123456 =" and ex.answer == "201080 7 10 123456"
    ids = tok(ex.prompt, add_special_tokens=False)["input_ids"]
    assert len(ids) == 7 and ids[2] == tok.convert_tokens_to_ids("201080") == 4 + 201_080
    assert task.score(ex, "201080 7 10 123456") == 1.0 and task.score(ex, "201080 7 1 0") == 0.5
    drawn = {d for e in task.sample(200, random.Random(0)) for d in e.answer.split()}
    assert max(int(d) for d in drawn) > 10_000  # draws cover the whole range, not the first ten
    assert get_task("copy", k=3, n_digits=10).vocab()[:10] == [str(d) for d in range(10)]  # small tasks unchanged
