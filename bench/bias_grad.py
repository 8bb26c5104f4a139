"""The experts' bias gradient alone: polyrl's ``BiasGather`` backward beside the sums it replaced, same run, same data.

Each expert's bias gradient is the sum of its rows of the incoming gradient; ``grouped_experts`` keeps the rows
sorted by expert, so each expert's rows are one contiguous run. Rows, timed as one backward of a float32 sum:
- ``polyrl``: ``polyrl.core.models.experts`` BiasGather as polyrl runs it on the device (torch's deterministic
  algorithms off on accelerators: ``torch.segment_reduce`` over the runs; on the CPU this script turns them on, as
  polyrl's CPU runs do: ``index_add_``);
- ``index_put``: ``index_put_(accumulate=True)``, the backward of ``bias[expert_ids]`` (what transformers' path and
  polyrl before the segmented sum ran on CUDA: a sort, then ``indexing_backward_kernel``);
- ``index_add_det``: ``index_add_`` under deterministic algorithms (the CPU's serial loop; sorted on CUDA);
- ``segment``: ``torch.segment_reduce`` alone, on any device;
- ``onehot``: ``one_hot(expert_ids)^T @ grad``, one float32 matmul.
Shapes: the tiny GPT-OSS recipe's micro-batch (4 experts, widths 128 and 64, ~5,000 rows) and GPT-OSS-20B width at
16k tokens, top-4 (32 experts, width 5,760, 65,536 rows). Prints each row's median, the ratio to polyrl's, and
whether it equals polyrl's bit for bit; writes JSON.

    python bench/bias_grad.py [--device cuda] [--shapes tiny 20b] [--out bench/results/bias_grad.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch

from polyrl.core.models import experts as E

SHAPES = {  # name -> (rows, width, experts)
    "tiny": [(5120, 128, 4), (5120, 64, 4)],
    "20b": [(65536, 5760, 32), (65536, 2880, 32)],
}


def _sums(experts: int):
    """Row name -> f(grad [S, W] float32, expert_ids [S] sorted, ends: their ``expert_ends``) -> [experts, W]
    float32 (polyrl's and the bare segmented sum get the forward's end rows, as grouped_experts hands them over)."""
    _, bias_gather = E._gathers()
    graph = []  # the bias and its gathered rows: the forward once (per shape), the backward timed

    def polyrl(grad, ids, ends):
        if not graph:
            bias = torch.zeros(experts, grad.shape[1], device=grad.device, requires_grad=True)
            graph.extend((bias, bias_gather.apply(bias, ids, ends)))
        bias, gathered = graph
        return torch.autograd.grad(gathered, bias, grad, retain_graph=True)[0]

    def index_put(grad, ids, ends):
        return grad.new_zeros(experts, grad.shape[1]).index_put_((ids,), grad, accumulate=True)

    def index_add_det(grad, ids, ends):
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            return grad.new_zeros(experts, grad.shape[1]).index_add_(0, ids, grad)
        finally:
            torch.use_deterministic_algorithms(before)

    def segment(grad, ids, ends):
        return E.segment_sums(grad, ends)

    def onehot(grad, ids, ends):
        return torch.nn.functional.one_hot(ids, experts).to(grad.dtype).t() @ grad

    return {"polyrl": polyrl, "index_put": index_put, "index_add_det": index_add_det, "segment": segment,
            "onehot": onehot}


def _time(fn, sync, reps: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results/bias_grad.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    # polyrl's CPU runs pin deterministic algorithms (polyrl.core.distributed); its accelerator runs leave them off
    torch.use_deterministic_algorithms(device.type == "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    results = []
    for shape in args.shapes:
        for rows, width, experts in SHAPES[shape]:
            ids = torch.sort(torch.randint(0, experts, (rows,), generator=gen))[0].to(device)
            grad = torch.randn(rows, width, generator=gen).to(device)
            ends = E.expert_ends(ids, experts)
            row = {"shape": shape, "rows": rows, "width": width, "experts": experts}
            sums = _sums(experts)
            ref = sums["polyrl"](grad, ids, ends)
            for name, fn in sums.items():
                out = fn(grad, ids, ends)
                ms = _time(lambda fn=fn, grad=grad, ids=ids, ends=ends: fn(grad, ids, ends), sync, args.reps) * 1e3
                row[name] = {"ms": ms, "equal_to_polyrl": bool(torch.equal(out, ref)),
                             "max_abs_diff": float((out - ref).abs().max())}
            results.append(row)
            ours = row["polyrl"]["ms"]
            print(f"{shape} rows {rows} width {width} experts {experts}: polyrl {ours:.4f} ms", flush=True)
            for name in list(sums)[1:]:
                r = row[name]
                same = "bit-equal" if r["equal_to_polyrl"] else "max diff {:.1e}".format(r["max_abs_diff"])
                print(f"  {name:>13}: {r['ms']:.4f} ms  polyrl/{name} {ours / r['ms']:.2f}  {same}")
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else device.type
    with open(args.out, "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "device": name, "torch": torch.__version__,
                   "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(), "results": results},
                  f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
