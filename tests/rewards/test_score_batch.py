"""score_batch never raises: errors, NaNs and timeouts score as failure and are counted."""

from __future__ import annotations

import math
import random
import time

import pytest

from polyrl.core.rewards import ScoreStats, score_batch
from polyrl.core.rewards.pool import BoundedPool
from polyrl.core.tasks import Example, get_task
from polyrl.core.tasks.math import MathTask


def _ex(answer: str, i: int = 0) -> Example:
    return Example(prompt="p", answer=answer, group_id=i)


class InlineTask:
    """Scores inline; misbehaves on request through the response text."""

    name = "inline"
    max_response_tokens = 4
    failure_score = 0.0

    def vocab(self):
        return []

    def sample(self, n, rng):
        return [_ex("a", i) for i in range(n)]

    def score(self, example, response):
        if response == "raise":
            raise RuntimeError("boom")
        if response == "nan":
            return math.nan
        if response == "slow":
            time.sleep(0.3)
        return 1.0


def remote_misbehaving(answer: str, response: str) -> float:
    """Top-level (picklable) reward for the worker-pool path."""
    if response == "raise":
        raise ValueError("bad")
    if response == "hang":
        time.sleep(60)
    if response == "nan":
        return float("nan")
    return 1.0 if response == answer else -1.0


class RemoteTask(InlineTask):
    name = "remote"
    failure_score = -1.0
    remote_score = staticmethod(remote_misbehaving)


def test_inline_errors_nans_and_slow_calls_score_failure():
    task = InlineTask()
    responses = ["ok", "raise", "nan", "slow", "ok"]
    scores, stats = score_batch(task, task.sample(5, None), responses, timeout_s=0.1)
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert stats == ScoreStats(errors=2, timeouts=1)


def test_synthetic_task_scores_inline_without_a_pool(monkeypatch):
    import polyrl.core.rewards.batch as batch

    def no_pool():
        raise AssertionError("synthetic tasks must not start the worker pool")

    monkeypatch.setattr(batch, "shared_pool", no_pool)
    task = get_task("copy")
    examples = task.sample(64, random.Random(0))
    scores, stats = score_batch(task, examples, [e.answer for e in examples])
    assert scores == [1.0] * 64 and stats == ScoreStats(errors=0, timeouts=0)


def test_remote_errors_and_hangs_are_bounded_and_counted(monkeypatch):
    import polyrl.core.rewards.batch as batch

    pool = BoundedPool(processes=2)
    monkeypatch.setattr(batch, "shared_pool", lambda: pool)
    try:
        task = RemoteTask()
        responses = ["a", "raise", "hang", "nan", "b"]
        start = time.monotonic()
        scores, stats = score_batch(task, [_ex("a", i) for i in range(5)], responses, timeout_s=0.5)
        elapsed = time.monotonic() - start
        assert scores == [1.0, -1.0, -1.0, -1.0, -1.0]
        assert stats == ScoreStats(errors=2, timeouts=1)
        assert elapsed < 5.0  # the hang was cut at the 0.5 s bound, not after 60 s
        # the pool is still usable afterwards
        scores, stats = score_batch(task, [_ex("a")], ["a"], timeout_s=0.5)
        assert scores == [1.0] and stats.timeouts == 0
    finally:
        pool.close()


def test_math_task_end_to_end(tmp_path, monkeypatch):
    import polyrl.core.rewards.batch as batch

    pool = BoundedPool(processes=2)
    monkeypatch.setattr(batch, "shared_pool", lambda: pool)
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "What is 1/2 + 0?", "answer": "\\\\frac{1}{2}"}\n'
                    '{"prompt": "What is 6*7?", "answer": "42"}\n')
    try:
        task = get_task("math", path=str(data))
        assert isinstance(task, MathTask) and task.vocab() == []
        examples = task.sample(4, random.Random(0))
        # epochs: each row once per two samples
        assert sorted(e.meta["row"] for e in examples[:2]) == [1, 2]
        responses = ["Answer: 0.5" if e.answer != "42" else "so \\boxed{41}" for e in examples]
        scores, stats = score_batch(task, examples, responses, timeout_s=5.0)
        expected = [1.0 if e.answer != "42" else -1.0 for e in examples]
        assert scores == expected
        assert stats == ScoreStats(errors=0, timeouts=0)
    finally:
        pool.close()


def test_mismatched_lengths_are_a_bug_not_a_reward_failure():
    with pytest.raises(ValueError):
        score_batch(InlineTask(), [_ex("a")], [])


def remote_ignoring_signals(answer: str, response: str) -> float:
    """Blocks SIGALRM, like a call stuck in C code that never returns to the interpreter."""
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(60)
    return 1.0


class StuckTask(RemoteTask):
    remote_score = staticmethod(remote_ignoring_signals)


def test_a_worker_that_ignores_its_alarm_is_killed_by_the_batch_deadline(monkeypatch):
    import polyrl.core.rewards.batch as batch

    pool = BoundedPool(processes=1)
    monkeypatch.setattr(batch, "shared_pool", lambda: pool)
    try:
        start = time.monotonic()
        scores, stats = score_batch(StuckTask(), [_ex("a")], ["a"], timeout_s=0.2)
        assert time.monotonic() - start < 10.0
        assert scores == [-1.0] and stats == ScoreStats(errors=0, timeouts=1)
        assert pool.restarts == 1
        scores, _ = score_batch(RemoteTask(), [_ex("a")], ["a"], timeout_s=0.5)  # a fresh pool answers
        assert scores == [1.0]
    finally:
        pool.close()


def remote_crashing(answer: str, response: str) -> float:
    """A verifier that kills its own process: a segfault in C code, or the OOM killer (no core file left)."""
    import faulthandler
    import os
    import resource
    import signal

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    faulthandler.disable()  # pytest's: its dump of the dying worker is not what the test looks at
    if response in ("segv", "kill"):
        os.kill(os.getpid(), signal.SIGSEGV if response == "segv" else signal.SIGKILL)
    return 1.0 if response == answer else -1.0


class CrashingTask(RemoteTask):
    remote_score = staticmethod(remote_crashing)


def test_a_worker_that_dies_is_one_failure_named_at_once(monkeypatch):
    """A call that kills its worker is answered 'crashed' (naming the signal) as soon as the worker is gone, not
    at the batch deadline; the other calls of the batch keep their scores, and the next batch gets a fresh pool."""
    import polyrl.core.rewards.batch as batch

    pool = BoundedPool(processes=2)
    monkeypatch.setattr(batch, "shared_pool", lambda: pool)
    try:
        responses = ["a", "segv", "b", "kill", "a", "segv"]
        start = time.monotonic()
        # a 20 s bound: the batch deadline would be 20 * (3 + 1) + 2 s away
        scores, stats = score_batch(CrashingTask(), [_ex("a", i) for i in range(6)], responses, timeout_s=20.0)
        assert time.monotonic() - start < 15.0
        assert scores == [1.0, -1.0, -1.0, -1.0, 1.0, -1.0]
        assert stats == ScoreStats(errors=3, timeouts=0, crashed=3)
        assert stats.last_failure == "reward worker killed by SIGSEGV"
        assert pool.crashes == 3 and pool.restarts == 1
        scores, stats = score_batch(CrashingTask(), [_ex("a")], ["a"], timeout_s=5.0)
        assert scores == [1.0] and stats == ScoreStats()
    finally:
        pool.close()


def test_a_worker_that_outlives_the_terminating_sigterm_is_killed(monkeypatch):
    """Terminating, the pool SIGTERMs its workers and joins them; a worker that the SIGTERM does not end (one
    forked as a replacement that got it before its initializer reset the trainer's inherited stop handler: seen
    under load, the run hung in Pool.terminate's join) is SIGKILLed, so dropping the pool returns."""
    import signal
    import threading

    import polyrl.core.rewards.pool as pool_mod

    original = pool_mod._init_worker

    def deaf_to_sigterm(started=None):
        original(started)
        signal.signal(signal.SIGTERM, lambda *_: None)  # as the inherited stop handler: a flag, no exit

    monkeypatch.setattr(pool_mod, "_init_worker", deaf_to_sigterm)
    monkeypatch.setattr(pool_mod, "REAP_AFTER_S", 0.5)
    pool = BoundedPool(processes=1)
    out: list = []
    # stuck past the batch deadline (0.2 s x 2 + 2 s): the pool is dropped, its worker sleeping 60 s
    calling = threading.Thread(target=lambda: out.append(pool.map(remote_ignoring_signals, [("a", "a")], 0.2)),
                               daemon=True)
    start = time.monotonic()
    calling.start()
    calling.join(30.0)
    assert not calling.is_alive(), "the pool's terminate waited on a worker that SIGTERM does not end"
    assert time.monotonic() - start < 10.0
    assert out == [[("timeout", "worker did not answer before the batch deadline")]] and pool.restarts == 1
