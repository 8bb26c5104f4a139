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
