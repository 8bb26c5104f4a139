"""DAPO: overlong shaping, group filtering and the dynamic sampler's bookkeeping."""

from __future__ import annotations

import pytest
import torch

from polyrl.core import algorithms as A


def test_overlong_penalty_hand_worked() -> None:
    # L_max 20480, buffer 4096 -> free up to 16384, −factor at 20480
    out = A.overlong_penalty(torch.tensor([100, 16384, 18432, 20480]), 20480, 4096, 1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.5, -1.0]))
    out = A.overlong_penalty([10, 12], 12, 4, factor=0.5)  # free up to 8
    torch.testing.assert_close(out, torch.tensor([-0.25, -0.5]))
    assert (A.overlong_penalty(torch.arange(0, 13), 12, 4) <= 0).all()
    with pytest.raises(ValueError):
        A.overlong_penalty([1], 10, 0)


def test_filter_groups() -> None:
    acc = [1, 1, 0, 1, 0, 0, 1, 0.3]
    ids = ["a", "a", "b", "b", "c", "c", "d", "e"]
    keep = A.filter_groups(acc, ids)
    # a constant (1,1) -> drop; b varies -> keep; c constant (0,0) -> drop; d singleton -> kept (verl);
    # e singleton -> kept
    assert keep.tolist() == [False, False, True, True, False, False, True, True]
    strict = A.filter_groups(acc, ids, keep_singletons=False)
    assert strict.tolist() == [False, False, True, True, False, False, False, False]


def test_filter_groups_identical_floats_are_constant() -> None:
    # mean of three 0.1s is not exactly 0.1 in floating point: np.std would give ~1e-17 > 0
    keep = A.filter_groups(torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64), [0, 0, 0])
    assert keep.tolist() == [False, False, False]


def _batch(ids: list[str], acc: list[float]) -> dict:
    n = len(ids)
    return {"uid": ids, "tokens": torch.arange(n * 2).reshape(n, 2), "acc": torch.tensor(acc)}


def test_dynamic_sampler_fills_and_truncates() -> None:
    s = A.DynamicSampler(target_groups=3, max_num_gen_batches=5)
    b1 = _batch(["p", "p", "q", "q", "r", "r"], [1, 0, 1, 1, 0, 1])  # p, r kept; q filtered
    kept = s.add(b1["uid"], b1["acc"], b1)
    assert kept["uid"] == ["p", "p", "r", "r"]
    assert not s.is_full
    b2 = _batch(["x", "x", "y", "y", "z", "z"], [0, 1, 1, 0, 0, 0])  # x, y kept, z filtered
    s.add(b2["uid"], b2["acc"], b2)
    assert s.is_full
    assert s.metrics() == {
        "num_gen_batches": 2,
        "kept_groups": 4,
        "filtered_groups": 2,
        "kept_rows": 8,
        "filtered_rows": 4,
    }
    out = s.result()
    assert out["uid"] == ["p", "p", "r", "r", "x", "x"]  # exactly 3 groups, arrival order
    torch.testing.assert_close(out["tokens"], torch.tensor([[0, 1], [2, 3], [8, 9], [10, 11], [0, 1], [2, 3]]))
    s.reset()
    assert s.metrics()["num_gen_batches"] == 0 and not s.is_full


def test_dynamic_sampler_exhausted_message() -> None:
    s = A.DynamicSampler(target_groups=2, max_num_gen_batches=2)
    b = _batch(["p", "p"], [1, 1])
    s.add(b["uid"], b["acc"], b)
    with pytest.raises(A.DynamicSamplingExhausted, match=r"kept 0 of the 2 groups.*2 generation batches") as err:
        s.add(b["uid"], b["acc"], b)
    assert isinstance(err.value, RuntimeError)
    with pytest.raises(RuntimeError, match="not full"):
        s.result()


def test_dynamic_sampler_unlimited_and_payload_checks() -> None:
    s = A.DynamicSampler(target_groups=1, max_num_gen_batches=0)
    b = _batch(["p", "p"], [1, 1])
    for _ in range(20):
        s.add(b["uid"], b["acc"], b)  # never raises with max <= 0
    assert s.num_gen_batches == 20 and s.filtered_groups == 20
    with pytest.raises(ValueError, match="payload"):
        s.add(["a", "a"], [0, 1], {"x": [1]})
