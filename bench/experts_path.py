"""MoE experts path: polyrl's default ("polyrl": the bound backend's experts kernel; on CUDA, where torch's
deterministic algorithms are off, its bias gradients are segmented sums over the expert-sorted rows) beside
transformers' own default ("grouped_mm"), same run, same weights; and one more row, polyrl's path with another bias
gradient (a one-hot matmul), to compare on a GPU.

Two GPT-OSS-20B-width layers (hidden 2880, 32 experts, top-4; the ``gpt_oss_20b`` preset cut to 2 layers), bf16,
random init, built by ``polyrl.core.models.build_model`` on the active backend, one packed sequence, forward +
backward of a sum of the last hidden states (the experts dominate; attention is the same in both). Prints the
median step and peak memory of each, the ratio, and how far they agree (output and every gradient of the last
step, relative norm); writes JSON. Expert parallelism with ``ep=1`` is this path.

    python bench/experts_path.py [--backend cuda] [--preset gpt_oss_20b] [--tokens 4096] [--steps 10]
        [--rows polyrl grouped_mm onehot] [--out bench/results/experts_path.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch


def _bias_gathers(name: str, bias_grad):
    """polyrl's row gather and a bias gather (``bias.index_select(0, expert_ids)``) whose backward is
    ``bias_grad(grad, expert_ids, experts)`` in float32, cast back to the bias' dtype: the candidates below."""
    from polyrl.core.models import experts as E

    row_gather, _ = E._gathers()

    class BiasGather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, bias, expert_ids, ends):
            ctx.save_for_backward(expert_ids)
            ctx.experts, ctx.bias_dtype = bias.shape[0], bias.dtype
            return bias.index_select(0, expert_ids)

        @staticmethod
        def backward(ctx, grad):
            (expert_ids,) = ctx.saved_tensors
            return bias_grad(grad.float(), expert_ids, ctx.experts).to(ctx.bias_dtype), None, None

    BiasGather.__name__ = BiasGather.__qualname__ = name
    return row_gather, BiasGather


def onehot_bias_gathers():
    """polyrl's experts gathers with another bias gradient, for this benchmark only: each expert's bias gradient as
    one matmul, one_hot(expert ids)^T @ grad in float32, instead of polyrl's segmented sum (CUDA; deterministic too;
    E x S x width multiply-adds). Row ``polyrl, one-hot bias grad``."""

    def bias_grad(grad, expert_ids, experts):
        return torch.nn.functional.one_hot(expert_ids, experts).to(torch.float32).t() @ grad  # [E, S] @ [S, width]

    return _bias_gathers("OneHotBias", bias_grad)


# --rows key -> (row label, the experts implementation it builds, the gathers it swaps in; None: polyrl's own)
ROWS = {
    "polyrl": ("polyrl", "polyrl", None),
    "grouped_mm": ("grouped_mm", "grouped_mm", None),
    "onehot": ("polyrl, one-hot bias grad", "polyrl", onehot_bias_gathers),
}


def row_keys(requested: list[str]) -> list[str]:
    """The rows to run, in order: polyrl's and grouped_mm's always (every ratio is against grouped_mm, every
    bit-for-bit count against polyrl), then the requested others."""
    return ["polyrl", "grouped_mm", *(k for k in requested if k not in ("polyrl", "grouped_mm"))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=None)
    ap.add_argument("--preset", default="gpt_oss_20b", help="a gpt_oss preset (gpt_oss_tiny: a quick CPU try)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS),
                    help="which rows (polyrl and grouped_mm always run: the ratios are against grouped_mm)")
    ap.add_argument("--out", default="bench/results/experts_path.json")
    args = ap.parse_args()

    from polyrl.core.models import build_model
    from polyrl.core.plugins.selection import set_active_backend

    backend = set_active_backend(args.backend)
    device = backend.device(0)
    dtype = torch.bfloat16 if backend.is_accelerator else torch.float32
    from polyrl.core.models import experts as E

    rows = {}
    kept = {}  # row -> the last step's output and gradients (CPU float32), compared after all ran
    for key in row_keys(args.rows):
        impl, experts_impl, gathers = ROWS[key]
        E._GATHERS = gathers() if gathers else None  # None: polyrl's own, built on first use
        model = build_model(args.preset, attn_implementation="polyrl", experts_implementation=experts_impl,
                            dtype=dtype, overrides={"num_hidden_layers": 2}, seed=0, backend=backend).to(device)
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0)).to(device)
        pos = torch.arange(args.tokens, device=device)[None]
        times = []
        sync = getattr(torch, device.type).synchronize if device.type != "cpu" else (lambda: None)
        if device.type != "cpu":
            getattr(torch, device.type).reset_peak_memory_stats()
        for _ in range(args.steps + 2):
            sync()
            t0 = time.perf_counter()
            out = model.model(input_ids=ids, position_ids=pos).last_hidden_state
            out.float().sum().backward()
            sync()
            times.append(time.perf_counter() - t0)
            if len(times) == args.steps + 2:
                kept[impl] = [out.detach().float().cpu()] + [
                    p.grad.float().cpu() for n, p in sorted(model.named_parameters()) if p.grad is not None]
            model.zero_grad(set_to_none=True)
        peak = getattr(torch, device.type).max_memory_allocated() / 2**30 if device.type != "cpu" else float("nan")
        rows[impl] = {"median_ms": statistics.median(times[2:]) * 1e3, "peak_gib": peak}
        print(f"{impl:>26}: {rows[impl]['median_ms']:.2f} ms / step, peak {peak:.2f} GiB", flush=True)
        del model
        if device.type != "cpu":
            getattr(torch, device.type).empty_cache()
    E._GATHERS = None
    ratio = rows["polyrl"]["median_ms"] / rows["grouped_mm"]["median_ms"]
    for impl in rows:
        if impl != "grouped_mm":
            print(f"{impl} / transformers grouped_mm: {rows[impl]['median_ms'] / rows['grouped_mm']['median_ms']:.3f}")
    # Same weights, same input: the outputs must agree to the dtype's rounding (the forward is the same bit for bit;
    # with top-4 routing an input gradient sums a token's rows in another order).
    agree = {}
    for impl in (i for i in rows if i != "grouped_mm"):
        a, b = kept[impl], kept["grouped_mm"]
        errs = [float((x - y).norm() / y.norm().clamp_min(1e-30)) for x, y in zip(a, b)] if len(a) == len(b) else []
        same = sum(torch.equal(x, y) for x, y in zip(a, kept["polyrl"])) if impl != "polyrl" else None
        agree[impl] = {"output_rel": errs[0] if errs else None, "tensors": len(errs), "bitwise_equal_to_polyrl": same,
                       "worst_grad_rel": max(errs[1:]) if len(errs) > 1 else None}
        print(f"{impl} against grouped_mm, same weights: output {errs[0]:.2e}, worst of {len(errs) - 1} gradients "
              f"{max(errs[1:]):.2e}" + ("" if same is None else f"; {same} of {len(a)} tensors equal to polyrl's")
              if len(errs) > 1 else f"{impl}: outputs not comparable")
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else device.type
    with open(args.out, "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "device": name, "torch": torch.__version__,
                   "tokens": args.tokens, "rows": rows, "ratio": ratio, "agreement": agree}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
