"""Where the fused loss's time goes: ``cublas_linear_logprob_loss`` (the loss's gradient inside the forward, dW summed
over token chunks) timed at several token-chunk budgets and dW accumulator choices, beside the four-matmul fused
log-prob path (``cublas_linear_logprobs`` + its backward) and Liger's fused linear cross-entropy in the same run.

The chunk budget (polyrl.core.algorithms.linear_loss.FUSED_CHUNK_BYTES, 384 MiB: 256 rows at GPT-OSS's 201,088-token
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
import sys
import time

import torch

ENT_W = 0.01


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
    from polyrl.backends.cuda.linear_logprobs import cublas_linear_logprob_loss, cublas_linear_logprobs

    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(args.T, args.H, generator=g) * 0.5).to(args.device, dtype).requires_grad_()
    W = (torch.randn(args.V, args.H, generator=g) * 0.02).to(args.device, dtype).requires_grad_()
    y = torch.randint(0, args.V, (args.T,), generator=g).to(args.device)
    w = torch.randn(args.T, generator=g).to(args.device)

    def four(h, W):
        lp, ent = cublas_linear_logprobs(h, W, y, chunk_size=2048)
        return (lp * w).sum() + ENT_W * ent.sum()

    def three(h, W):
        def token_grad(t0, t1, lp, ent):
            return w[t0:t1], torch.full_like(ent, ENT_W)

        anchor, lp, ent = cublas_linear_logprob_loss(h, W, y, token_grad, chunk_size=2048)
        return (lp * w).sum() + ENT_W * ent.sum() + anchor

    ref_grad: list[torch.Tensor] = []

    def measure(fn) -> dict:
        def once():
            h.grad = W.grad = None
            fn(h, W).backward()

        once()
        grad = W.grad.float().clone()
        if not ref_grad:  # the first row measured: the four-matmul path
            ref_grad.append(grad)
        diff = float((grad - ref_grad[0]).norm() / ref_grad[0].norm().clamp(min=1e-30))
        extra = None
        if cuda:
            once()
            h.grad = W.grad = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            once()
            torch.cuda.synchronize()
            extra = (torch.cuda.max_memory_allocated() - base) / 2**30
        times = []
        for _ in range(args.iters):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                once()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                once()
                times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return {"ms": times[len(times) // 2], "extra_gib": extra, "grad_w_rel_diff": diff}

    rows = {"four matmuls (cublas_linear_logprobs)": measure(four)}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        rows["liger fused linear CE (no entropy)"] = measure(lambda h, W: liger(W, h, y))
    except Exception as exc:  # missing, or installed without its GPU dependencies
        print(f"liger not run: {type(exc).__name__}: {exc}")
    saved = (LOSS.FUSED_CHUNK_BYTES, LOSS.DW_FP32_BYTES)
    try:
        for mib in args.budgets_mib:
            LOSS.FUSED_CHUNK_BYTES = int(mib * 2**20)
            rows_c = LOSS.fused_token_chunk(args.T, args.V, torch.tensor([], dtype=dtype).element_size(), 2048)
            for dw32 in (False, True):
                LOSS.DW_FP32_BYTES = 2**40 if dw32 else saved[1]
                name = f"fused loss, {rows_c}-row chunks, dW summed in {'fp32' if dw32 else 'the weight dtype'}"
                rows[name] = measure(three)
                rows[name]["chunk_rows"] = rows_c
    finally:
        LOSS.FUSED_CHUNK_BYTES, LOSS.DW_FP32_BYTES = saved
    ref = rows["four matmuls (cublas_linear_logprobs)"]["ms"]
    peer = rows.get("liger fused linear CE (no entropy)", {}).get("ms")
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
