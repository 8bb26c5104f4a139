"""Rollout correction against hand-computed oracles: every IS level, the IcePop band, both sequence rejections,
the weighted policy loss, the mismatch metrics (also split over two gloo ranks), the edge cases (one token, all
tokens masked, padding that holds garbage, sequences of different lengths)."""

from __future__ import annotations

import dataclasses
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from polyrl.core import algorithms as A
from polyrl.core.algorithms import rollout_correction as RC
from polyrl.core.config import RolloutCorrectionConfig
from polyrl.core.trainer.mismatch import resolve_enable, rollout_correction

NAN = float("nan")
# Two sequences of 3 and 2 tokens; token ratios r = π_old/μ of [2, 0.5, 4] and [1.5, 0.25]; the padding slot holds
# NaN in both log-probs (never read: a NaN would poison every figure).
RATIOS = [[2.0, 0.5, 4.0], [1.5, 0.25, NAN]]


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.log(torch.tensor(RATIOS)) - 1.0  # log π_old
    roll = torch.full_like(old, -1.0)  # log μ
    roll[1, 2] = NAN
    return old, roll, mask


def _delta() -> tuple[torch.Tensor, torch.Tensor]:
    old, roll, mask = _batch()
    return RC.log_ratio(old, roll, mask), mask


def test_log_ratio_is_zero_on_padding_whatever_it_holds() -> None:
    d, _ = _delta()
    assert torch.isfinite(d).all() and d[1, 2] == 0
    assert torch.allclose(d.exp()[0], torch.tensor([2.0, 0.5, 4.0]))


@pytest.mark.parametrize(("level", "rho", "w"), [
    # token: ρ_t = r_t, w = min(ρ, 2)
    ("token", [[2, 0.5, 4], [1.5, 0.25, 0]], [[2, 0.5, 2], [1.5, 0.25, 0]]),
    # sequence: ρ = Π r_t = 4 and 0.375
    ("sequence", [[4, 4, 4], [0.375, 0.375, 0]], [[2, 2, 2], [0.375, 0.375, 0]]),
    # geometric: ρ = (Π r_t)^(1/n) = 4^(1/3), 0.375^(1/2)
    ("geometric", [[4 ** (1 / 3)] * 3, [0.375 ** 0.5] * 2 + [0]], [[4 ** (1 / 3)] * 3, [0.375 ** 0.5] * 2 + [0]]),
])
def test_is_weights_at_each_level(level: str, rho: list, w: list) -> None:
    d, mask = _delta()
    got_rho, got_w = RC.is_weights(d, mask, level, 2.0)
    assert torch.allclose(got_rho, torch.tensor(rho), rtol=1e-6)
    assert torch.allclose(got_w, torch.tensor(w), rtol=1e-6)


def test_is_weights_of_one_token_and_the_exponent_bound() -> None:
    one = torch.ones(1, 1)
    for level in RC.IS_LEVELS:
        rho, w = RC.is_weights(torch.tensor([[math.log(3.0)]]), one, level, 2.0)
        assert rho.item() == pytest.approx(3.0) and w.item() == pytest.approx(2.0)
    rho, _ = RC.is_weights(torch.tensor([[15.0, 15.0]]), torch.ones(1, 2), "sequence", 2.0)
    assert rho[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-5)  # exp(30) bounded at exp(20)
    with pytest.raises(ValueError, match="cap"):
        RC.is_weights(torch.zeros(1, 1), one, "token", 0.0)


@pytest.mark.parametrize(("kwargs", "keep"), [
    ({}, [[1, 1, 1], [1, 1, 0]]),
    # IcePop: keep 0.4 <= r <= 3: drops the 4 and the 0.25
    ({"token_band": (0.4, 3.0)}, [[1, 1, 0], [1, 0, 0]]),
    # max_token: a sequence with a token outside [0.2, 3] (the 4) is dropped whole; 0.25 >= 0.2 keeps the second
    ({"reject": "max_token", "reject_band": (0.2, 3.0)}, [[0, 0, 0], [1, 1, 0]]),
    # geometric: 4^(1/3) = 1.587 inside [0.7, 1.7]; 0.375^(1/2) = 0.612 outside
    ({"reject": "geometric", "reject_band": (0.7, 1.7)}, [[1, 1, 1], [0, 0, 0]]),
    ({"reject": "geometric", "reject_band": (0.6, 1.7)}, [[1, 1, 1], [1, 1, 0]]),
    # both: the band drops tokens, the rejection whole sequences
    ({"token_band": (0.4, 3.0), "reject": "geometric", "reject_band": (0.7, 1.7)}, [[1, 1, 0], [0, 0, 0]]),
    # everything rejected
    ({"reject": "max_token", "reject_band": (0.9, 1.1)}, [[0, 0, 0], [0, 0, 0]]),
])
def test_keep_mask(kwargs: dict, keep: list) -> None:
    d, mask = _delta()
    assert RC.keep_mask(d, mask, **kwargs).tolist() == keep


def test_keep_mask_refuses_a_rejection_without_its_band() -> None:
    d, mask = _delta()
    with pytest.raises(ValueError, match="band"):
        RC.keep_mask(d, mask, reject="geometric")
    with pytest.raises(ValueError, match="one of"):
        RC.keep_mask(d, mask, reject="worst", reject_band=(0.5, 2.0))


def test_k1_k3_per_token() -> None:
    d, mask = _delta()
    k1, k3 = RC.k1_k3(d, mask)
    r = torch.tensor([[2, 0.5, 4], [1.5, 0.25, 1.0]])
    assert torch.allclose(k1, -torch.log(r) * mask, rtol=1e-6)
    assert torch.allclose(k3, (r - 1 - torch.log(r)) * mask, rtol=1e-5, atol=1e-7)
    assert (k3 >= 0).all() and k3[1, 2] == 0


def test_policy_loss_with_weights_is_the_hand_weighted_loss() -> None:
    # ratios π/π_old of 1.5, 0.5, 1.1, 1 (ε 0.2 / 0.28), advantages +1, −1, +2, −1, weights 2, 0.5, 1.5, 9 and the
    # last token masked: per token max(−A r, −A clip(r)) = −1.28, 0.8, −2.2; weighted: −2.56, 0.4, −3.3
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.0]])).requires_grad_()
    old, mask = torch.zeros(1, 4), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, w = torch.tensor([[1.0, -1.0, 2.0, -1.0]]), torch.tensor([[2.0, 0.5, 1.5, 9.0]])
    loss, met = A.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, weights=w)
    assert loss.item() == pytest.approx((-2.56 + 0.4 - 3.3) / 3, rel=1e-6)
    unweighted, met0 = A.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert unweighted.item() == pytest.approx((-1.28 + 0.8 - 2.2) / 3, rel=1e-6)
    assert met == met0  # the clip fractions describe the ratio, not the weights
    loss.backward()  # d/dlogp of −w·A·r where unclipped (the third token): −1.5·2·1.1 / 3; clipped ones: 0
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.0, -1.5 * 2 * 1.1 / 3, 0.0], rel=1e-6)
    # weights of ones give today's loss exactly
    ones, _ = A.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, weights=torch.ones(1, 4))
    assert ones.item() == unweighted.item()


def test_policy_loss_with_the_kept_tokens_as_its_mask() -> None:
    # what the update does with the correction's mask: the kept tokens replace the response mask (and its count)
    logp, old = torch.log(torch.tensor([[1.5, 0.5, 1.1]])), torch.zeros(1, 3)
    adv, mask, keep = torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3), torch.tensor([[1.0, 0.0, 1.0]])
    loss, _ = A.policy_loss(logp, old, adv, mask * keep, clip_low=0.2, clip_high=0.28,
                            global_tokens=A.global_token_count(mask * keep))
    assert loss.item() == pytest.approx((-1.28 - 2.2) / 2, rel=1e-6)
    nothing, _ = A.policy_loss(logp, old, adv, mask * 0, clip_low=0.2, clip_high=0.28)
    assert nothing.item() == 0.0


def _rc(**kw) -> RolloutCorrectionConfig:
    return dataclasses.replace(RolloutCorrectionConfig(), **{"enable": True, **kw})


def test_rollout_correction_on_gives_weights_and_mask() -> None:
    old, roll, mask = _batch()
    w, keep, m = rollout_correction(_rc(), old, roll, mask)
    assert keep is None and torch.allclose(w, torch.tensor([[2, 0.5, 2], [1.5, 0.25, 0]]))
    w, keep, _ = rollout_correction(_rc(is_level=None, token_mask_band=[0.4, 3.0]), old, roll, mask)
    assert w is None and keep.tolist() == [[1, 1, 0], [1, 0, 0]]
    w, keep, m = rollout_correction(_rc(enable=False, token_mask_band=[0.4, 3.0]), old, roll, mask)
    assert w is None and keep is None  # off: the update is today's; the metrics say what it would do
    assert m.mismatch_applied == 0 and m.mismatch_masked_frac == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="resolve"):
        rollout_correction(dataclasses.replace(RolloutCorrectionConfig(), enable="auto"), old, roll, mask)


def _oracle_token_metrics() -> dict[str, float]:
    r = [2.0, 0.5, 4.0, 1.5, 0.25]
    w = [min(x, 2.0) for x in r]
    return {
        "mismatch/applied": 1, "mismatch/k1": -math.log(1.5) / 5,  # Π r = 1.5
        "mismatch/k3": sum(x - 1 - math.log(x) for x in r) / 5,
        "mismatch/seq_k1": (-math.log(4.0) - math.log(0.375)) / 2,
        "mismatch/is_mean": sum(w) / 5, "mismatch/is_max": 4.0, "mismatch/is_clipped_frac": 1 / 5,
        "mismatch/masked_frac": 0.0,
        "mismatch/seq_is_mean": ((2 + 0.5 + 2) / 3 + (1.5 + 0.25) / 2) / 2,
        "mismatch/seq_is_max": (2 + 0.5 + 4) / 3, "mismatch/seq_clipped_frac": 0.5, "mismatch/seq_masked_frac": 0.0,
    }


def _flat(m) -> dict[str, float]:
    from polyrl.core.trainer.metrics import flatten

    return flatten(m)


def test_mismatch_metrics_hand_computed() -> None:
    old, roll, mask = _batch()
    _, _, m = rollout_correction(_rc(), old, roll, mask)
    got, want = _flat(m), _oracle_token_metrics()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k


def test_mismatch_metrics_of_the_sequence_levels_and_a_rejection() -> None:
    old, roll, mask = _batch()
    got = _flat(rollout_correction(_rc(is_level="sequence", seq_reject="max_token", seq_reject_band=[0.2, 3.0]),
                                   old, roll, mask)[2])
    # ρ = 4 (capped to 2) on 3 tokens, 0.375 on 2; the first sequence is rejected (its 4 > 3)
    assert got["mismatch/is_mean"] == pytest.approx((3 * 2 + 2 * 0.375) / 5)
    assert got["mismatch/is_max"] == pytest.approx(4.0) and got["mismatch/is_clipped_frac"] == pytest.approx(3 / 5)
    assert got["mismatch/seq_is_mean"] == pytest.approx((2 + 0.375) / 2)
    assert got["mismatch/seq_is_max"] == pytest.approx(4.0) and got["mismatch/seq_clipped_frac"] == 0.5
    assert got["mismatch/masked_frac"] == pytest.approx(3 / 5) and got["mismatch/seq_masked_frac"] == 0.5
    geo = _flat(rollout_correction(_rc(is_level="geometric"), old, roll, mask)[2])
    assert geo["mismatch/is_max"] == pytest.approx(4 ** (1 / 3), rel=1e-6)
    assert geo["mismatch/is_clipped_frac"] == 0.0


def test_mismatch_metrics_when_everything_is_masked_and_for_one_token() -> None:
    old, roll, mask = _batch()
    got = _flat(rollout_correction(_rc(seq_reject="max_token", seq_reject_band=[0.9, 1.1]), old, roll, mask)[2])
    assert got["mismatch/masked_frac"] == 1.0 and got["mismatch/seq_masked_frac"] == 1.0
    one = _flat(rollout_correction(_rc(), torch.tensor([[math.log(3.0)]]), torch.zeros(1, 1), torch.ones(1, 1))[2])
    assert one["mismatch/is_mean"] == pytest.approx(2.0) and one["mismatch/is_max"] == pytest.approx(3.0)
    assert one["mismatch/k1"] == pytest.approx(-math.log(3.0)) and one["mismatch/seq_k1"] == one["mismatch/k1"]
    assert one["mismatch/is_clipped_frac"] == 1.0 and one["mismatch/seq_clipped_frac"] == 1.0
    # a batch with no response token at all: zeros, not NaN
    empty = _flat(rollout_correction(_rc(), torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2))[2])
    assert all(math.isfinite(v) for v in empty.values()) and empty["mismatch/is_max"] == 0.0


def test_resolve_enable_says_what_it_chose() -> None:
    rc = RolloutCorrectionConfig()
    assert rc.enable == "auto"
    on, line = resolve_enable(rc, "vllm", True)
    assert on and "auto: engine vllm has its own weights" in line and "token-level IS weights capped at 2" in line
    off, line = resolve_enable(rc, "hf", False)
    assert not off and "off (auto: engine hf shares the trainer weights)" in line
    on, line = resolve_enable(dataclasses.replace(rc, enable=True, token_mask_band=[0.5, 5.0]), "hf", False)
    assert on and "enable=true" in line and "[0.5, 5.0]" in line


# --- two ranks: the global batch's figures, whatever each rank holds ------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        old, roll, mask = _batch()
        rows = slice(0, 1) if rank == 0 else slice(1, 2)  # 3 tokens on rank 0, 2 on rank 1
        out[rank] = _flat(rollout_correction(_rc(), old[rows], roll[rows], mask[rows])[2])
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_mismatch_metrics_over_two_ranks_are_the_global_batch() -> None:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(_free_port(), out), nprocs=2, join=True, start_method="spawn")
        results = dict(out)
    want = _oracle_token_metrics()
    for rank in (0, 1):
        for k, v in want.items():
            assert results[rank][k] == pytest.approx(v, rel=1e-6, abs=1e-9), (rank, k)
