"""One rank of tests/ascend/test_hccl_collectives.py, started by torchrun: runs a scenario and writes what it saw
to ``<out>/rank<R>.json``. Scenarios:

- ``emulated``: the ascend backend in CPU mode (``enable_emulation``), its process group opened by
  ``init_distributed``: what HCCL refuses is refused, and polyrl's collectives give the float64 numbers;
- ``gloo``: plain gloo, the gather reduction forced, against gloo's own float64 all-reduce;
- ``world``: the emulated HCCL group opened directly with any world size (3 included): the gathers into one tensor.

The emulated torch_npu release is ``POLYRL_NPU_EMULATOR_VERSION`` (HcclAlltoAllV's types depend on it).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist


def _values(rank: int) -> dict[str, torch.Tensor]:
    """Per-rank float64 values like the trainer's: token counts, loss sums, a squared sum, and numbers whose
    float32 rounding would show (1e8 + a fraction; a tiny one)."""
    gen = torch.Generator().manual_seed(100 + rank)
    return {
        "token_counts": torch.tensor([1537.0 + rank * 211, 96.0, 0.0], dtype=torch.float64),
        "loss_sums": torch.randn(4, generator=gen, dtype=torch.float64) * 1e3,
        "large": torch.tensor([1e8 + 0.123456789 * (rank + 1), 3e-9 * (rank + 1)], dtype=torch.float64),
    }


def _reduce_all(D, rank: int, world: int) -> dict:
    """polyrl's all_reduce_ on every value and op, and the float64 reference from every rank's values."""
    mine = _values(rank)
    everyone = [_values(r) for r in range(world)]
    out = {}
    for key, value in mine.items():
        stack = torch.stack([v[key] for v in everyone])
        refs = {"sum": stack.sum(0), "max": stack.amax(0), "min": stack.amin(0), "avg": stack.sum(0) / world}
        for op, ref in refs.items():
            got = D.all_reduce_(value.clone(), op)
            out[f"{key}/{op}"] = {"got": got.tolist(), "ref": ref.tolist(), "dtype": str(got.dtype)}
    return out


def _all_to_all(backend, rank: int, world: int) -> dict:
    """bf16 rows (as expert parallelism sends them) with uneven splits: rank p sends 1 + p + 2q rows to rank q;
    then splits where rank 0 sends and receives no rows at all (0-row tensors). Before torch_npu 2.8.0.post2
    HCCL's all-to-all refuses bf16; the backend's all_to_all must deliver every row bit for bit on every release."""
    def exchange(name: str, tail: tuple[int, ...], rows: Callable[[int, int], int]) -> None:
        def sent(p: int) -> torch.Tensor:
            n = sum(rows(p, q) for q in range(world))
            return torch.randn(n, *tail, generator=torch.Generator().manual_seed(50 + p)).to(torch.bfloat16)

        send = [rows(rank, q) for q in range(world)]
        recv = [rows(p, rank) for p in range(world)]
        mine = sent(rank)
        want = torch.cat([sent(p).split([rows(p, q) for q in range(world)])[rank] for p in range(world)])
        got = torch.full((sum(recv), *tail), float("nan"), dtype=torch.bfloat16)
        try:
            dist.all_to_all_single(got, mine, recv, send)
            out[f"{name}/raw"] = "accepted"
        except RuntimeError as exc:
            out[f"{name}/raw"] = str(exc)
        got.fill_(float("nan"))
        backend.all_to_all(got, mine, recv, send)
        out[f"{name}/exact"] = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
        out[f"{name}/rows"] = [int(mine.shape[0]), int(got.shape[0])]

    out: dict = {}
    exchange("rows", (6,), lambda p, q: 1 + p + 2 * q)
    exchange("vector", (), lambda p, q: 1 + p + 2 * q)
    exchange("empty", (6,), lambda p, q: 0 if p == 0 or q == 0 else 3)
    counts = torch.arange(world, dtype=torch.int64) + 10 * rank  # the row counts travel as int64
    back = torch.empty_like(counts)
    backend.all_to_all(back, counts, None, None)
    out["counts"] = back.tolist()
    return out


def emulated(rank: int, world: int) -> dict:
    from polyrl.core import distributed as D
    from polyrl.core.plugins import get_registry
    from polyrl.emulation import enable_emulation

    enable_emulation("ascend")
    backend = get_registry().backends["ascend"]
    D.init_distributed(backend)
    seen: dict = {"backend": dist.get_backend()}
    for name, call in (("fp64", lambda: dist.all_reduce(torch.ones(2, dtype=torch.float64))),
                       ("bool", lambda: dist.all_reduce(torch.tensor([True, False]))),
                       ("bool_reduce_scatter", lambda: dist.reduce_scatter_tensor(
                           torch.empty(1, dtype=torch.bool), torch.ones(world, dtype=torch.bool))),
                       ("avg", lambda: dist.all_reduce(torch.full((2,), 1.0 + rank), op=dist.ReduceOp.AVG)),
                       ("band", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND))):
        try:
            call()
            seen[name] = "accepted"
        except RuntimeError as exc:
            seen[name] = str(exc)
    got = torch.tensor([rank == 0, False])  # HCCL: cast to int32, summed, copied back: an OR over ranks
    dist.all_reduce(got)
    seen["bool_value"] = got.tolist()
    got = torch.full((2,), 1.0 + rank)  # AVG: a SUM, then a division by the group size
    dist.all_reduce(got, op=dist.ReduceOp.AVG)
    seen["avg_value"] = got.tolist()
    got = torch.arange(2 * world, dtype=torch.float32) * (rank + 1)
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, got, op=dist.ReduceOp.AVG)
    seen["avg_reduce_scatter"] = out.tolist()
    seen["reductions"] = _reduce_all(D, rank, world)
    seen["metrics"] = D.all_reduce_metrics({"a": 1.5 + rank, "n": 10.0 * (rank + 1)}, op="sum")
    seen["all_to_all"] = _all_to_all(backend, rank, world)
    # polyrl's FSDP2 over the emulated group: all_gather_into_tensor (parameters), reduce_scatter of float32
    # gradients with SUM (HCCL has no AVG: plain FSDP2 averaging is refused, which polyrl's sharding avoids)
    from polyrl.core.distributed.sharding import apply_sharding

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)])
    model.forward = lambda x: model.layers[1](model.layers[0](x))
    model = apply_sharding(model, backend)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank), dtype=torch.bfloat16)
    model(x).float().square().sum().backward()
    seen["fsdp_grad_norm"] = float(sum(p.grad.full_tensor().double().square().sum() for p in model.parameters()))
    D.barrier()  # both ranks done before either tears its groups down (else a peer's gloo pair may abort at exit)
    D.shutdown_distributed()
    return seen


def gloo(rank: int, world: int) -> dict:
    import polyrl.core.distributed.process_group as pg

    dist.init_process_group("gloo")
    out = {}
    for key, value in _values(rank).items():
        theirs = value.clone()
        dist.all_reduce(theirs)  # gloo's own float64 sum
        mine = value.clone()
        pg._all_reduce_by_gather_(mine, "sum")
        out[key] = {"gather": mine.tolist(), "gloo": theirs.tolist()}
    dist.destroy_process_group()
    return out


def world(rank: int, world_size: int) -> dict:
    from polyrl.emulation import hccl

    dist.init_process_group(hccl.register())
    seen = {}
    for name, call in (
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(world_size * 2), torch.ones(2))),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(world_size * 2))),
        ("all_gather", lambda: dist.all_gather([torch.empty(2) for _ in range(world_size)], torch.ones(2))),
    ):
        try:
            call()
            seen[name] = "accepted"
        except RuntimeError as exc:
            seen[name] = str(exc)
    dist.barrier()
    dist.destroy_process_group()
    return seen


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = {"emulated": emulated, "gloo": gloo, "world": world}[scenario](rank, size)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    from polyrl.core.distributed.process import leave_now

    leave_now(0)  # no interpreter teardown with gloo's work objects alive (as `polyrl run`'s workers end)
