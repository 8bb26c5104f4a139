"""Under FSDP every forward is a collective: ranks must agree on how many micro-batches and decode steps
they run. Two gloo processes (torch.multiprocessing), no trainer."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from polyrl.core import distributed as D
        from polyrl.core.rollout.hf import _all_ranks_done
        from polyrl.core.trainer.batch import micro_batches

        # rank 0: 4 short rows fit one micro-batch; rank 1: 4 long rows need 4
        lengths = [3, 3, 3, 3] if rank == 0 else [10, 10, 10, 10]
        parts = micro_batches(lengths, [0, 1, 2, 3], 12)
        done = torch.tensor([True, True]) if rank == 0 else torch.tensor([True, False])
        metrics = D.all_reduce_metrics({"a": float(rank), "t": float(rank)}, ops={"t": "max"})
        out[rank] = (parts, _all_ranks_done(done), metrics)
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_micro_batch_count_and_stopping() -> None:
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
    parts0, done0, m0 = out[0]
    parts1, done1, m1 = out[1]
    assert len(parts0) == len(parts1) == 4
    assert sorted(r for p in parts0 for r in p) == [0, 1, 2, 3]  # split, nothing lost or repeated
    assert parts1 == [[0], [1], [2], [3]]
    assert done0 is False and done1 is False  # rank 0 keeps decoding while rank 1 has a live row
    assert m0 == m1 == {"a": 0.5, "t": 1.0}
