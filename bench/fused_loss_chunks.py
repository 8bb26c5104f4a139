"""Where the fused loss's time goes: ``cublas_linear_logprob_loss`` (the loss's gradient inside the forward, dW summed
over token chunks) timed at several token-chunk budgets and dW accumulator choices, beside the four-matmul fused
log-prob path (``cublas_linear_logprobs`` + its backward) and Liger's fused linear cross-entropy in the same run.

The chunk budget (polyrl.core.algorithms.linear_loss.FUSED_CHUNK_BYTES, 768 MiB: 640 rows at GPT-OSS's 201,088-token
vocabulary in bf16) sets K of each dW update ``dW += ∂z_cᵀ h_c``: every update reads and writes the whole [V, H]
accumulator, so small chunks make dW's sum memory-bound. Prints ms and extra GiB per setting, ratios to the
four-matmul path and to Liger.

    python bench/fused_loss_chunks.py [--T 16384] [--budgets-mib 384 768 1536] [--out fused_loss_chunks.json]

A CUDA GPU by default (bf16, GPT-OSS-20B's lm_head shape). ``--device cpu`` (fp32, small shapes: the test of this
script) times with the wall clock and reports no memory. Every row also gives its W gradient's relative difference
to the four-matmul path's, so a setting that changes the result shows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from logprob_linear import _measure, _methods

FOUR, FUSED_LOSS, LIGER = "polyrl fused (cublas)", "polyrl fused loss (cublas)", "liger fused linear CE"
CHUNK = 2048  # the callers' chunk_size (the fused loss's token chunk is bounded by FUSED_CHUNK_BYTES below it)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--H", type=int, default=2880)
    ap.add_argument("--V", type=int, default=201088)
    ap.add_argument("--budgets-mib", type=float, nargs="+", default=[384, 768, 1536])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("fused_loss_chunks: needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if cuda else torch.float32
    import polyrl.core.algorithms.linear_loss as LOSS

    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(args.T, args.H, generator=g) * 0.5).to(args.device, dtype).requires_grad_()
    W = (torch.randn(args.V, args.H, generator=g) * 0.02).to(args.device, dtype).requires_grad_()
    y = torch.randint(0, args.V, (args.T,), generator=g).to(args.device)
    w = torch.randn(args.T, generator=g).to(args.device)
    # the same loss functions and timing as bench/logprob_linear.py's rows
    methods = _methods(args.device, CHUNK)
    ref_grad: list[torch.Tensor] = []

    def measure(name: str) -> dict:
        r = _measure(methods[name], h, W, y, w, args.device, args.iters)
        grad = W.grad.float().clone()  # the last timed call's
        if not ref_grad:  # the first row measured: the four-matmul path
            ref_grad.append(grad)
        r["grad_w_rel_diff"] = float((grad - ref_grad[0]).norm() / ref_grad[0].norm().clamp(min=1e-30))
        return r

    rows = {FOUR: measure(FOUR)}
    if callable(methods[LIGER]):
        rows[LIGER] = measure(LIGER)
    else:
        print(f"{LIGER}: {methods[LIGER]}")
    saved = (LOSS.FUSED_CHUNK_BYTES, LOSS.DW_FP32_BYTES)
    try:
        for mib in args.budgets_mib:
            LOSS.FUSED_CHUNK_BYTES = int(mib * 2**20)
            rows_c = LOSS.fused_token_chunk(args.T, args.V, dtype.itemsize, CHUNK)
            for dw32 in (False, True):
                LOSS.DW_FP32_BYTES = 2**40 if dw32 else saved[1]
                name = f"fused loss, {rows_c}-row chunks, dW summed in {'fp32' if dw32 else 'the weight dtype'}"
                rows[name] = measure(FUSED_LOSS)
                rows[name]["chunk_rows"] = rows_c
    finally:
        LOSS.FUSED_CHUNK_BYTES, LOSS.DW_FP32_BYTES = saved
    ref = rows[FOUR]["ms"]
    peer = rows.get(LIGER, {}).get("ms")
    print(f"{'setting':66s} {'ms':>8s} {'GiB':>6s} {'/4-mm':>6s} {'/liger':>7s} {'dW rel diff':>11s}")
    for name, r in rows.items():
        gib = f"{r['extra_gib']:6.2f}" if r["extra_gib"] is not None else f"{'-':>6s}"
        print(f"{name:66s} {r['ms']:8.2f} {gib} {r['ms'] / ref:6.2f} "
              f"{(r['ms'] / peer) if peer else float('nan'):7.2f} {r['grad_w_rel_diff']:11.1e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"T": args.T, "H": args.H, "V": args.V, "device": args.device, "dtype": str(dtype),
                       "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
