"""Global token/sequence counts across two gloo ranks: rank shares sum to the whole-batch token mean."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from polyrl.core import algorithms as A


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    lengths = torch.tensor([5, 1, 3, 0, 2, 4])
    mask = (torch.arange(5)[None] < lengths[:, None]).double()
    return x, mask


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        x, mask = _data()
        rows = [slice(0, 1), slice(1, 2)] if rank == 0 else [slice(2, 4), slice(4, 6)]  # 2 micro-batches each
        p = x.clone().requires_grad_()
        n_tok = A.global_token_count([mask[r] for r in rows])
        n_seq = A.global_seq_count([mask[r] for r in rows])
        loss = torch.zeros((), dtype=torch.float64)
        for mode in ("token-mean", "seq-mean-token-mean"):
            for r in rows:
                share = A.aggregate(p[r] ** 2, mask[r], mode, global_tokens=n_tok, global_seqs=n_seq)
                share.backward()
                loss = loss + share.detach()
        dist.all_reduce(p.grad)  # SUM, as documented
        dist.all_reduce(loss)
        out[rank] = (n_tok, n_seq, loss.item(), p.grad)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_rank_shares_sum_to_global_aggregate() -> None:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(_free_port(), out), nprocs=2, join=True, start_method="spawn")
        results = dict(out)
    x, mask = _data()
    p = x.clone().requires_grad_()
    full = A.aggregate(p**2, mask, "token-mean") + A.aggregate(p**2, mask, "seq-mean-token-mean")
    full.backward()
    for rank in (0, 1):
        n_tok, n_seq, loss, grad = results[rank]
        assert (n_tok, n_seq) == (15, 5)
        assert loss == pytest.approx(full.item(), rel=1e-12)
        torch.testing.assert_close(grad, p.grad, rtol=1e-12, atol=1e-12)
