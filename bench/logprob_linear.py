"""lm_head + per-token log-prob + entropy, forward + backward, at GPT-OSS-20B width: polyrl's fused op vs the
logits paths and the fused-linear-cross-entropy peers, in one run.

Every method starts from the same last hidden states [T, H] and lm_head weight [V, H] (bf16, both requiring
grad) and ends with their gradients:
- ``polyrl fused (triton)``: the cuda backend's Triton path, ``triton_fused_linear_logprobs`` (Triton forward with
  the matmul fused into the softmax statistics; Triton backward recomputing each vocabulary chunk's logit
  gradient, dW and dH by cuBLAS; ``POLYRL_LINEAR_LOGPROBS=triton``): log-probs and entropy;
- ``polyrl fused (cublas)``: the cuda backend's cuBLAS path, ``cublas_linear_logprobs``
  (``POLYRL_LINEAR_LOGPROBS=cublas``, the default: all four matmuls in cuBLAS with fp32 logits, Triton only reads them):
  same; the two rows call their paths directly, whatever the variable says;
- ``polyrl fused loss (cublas)``: ``cublas_linear_logprob_loss`` (polyrl.core.algorithms.linear_loss): the same loss's
  per-token gradient (w, and the entropy weight) handed to the op, which takes it inside its forward's token chunks
  and so makes the logits once (three lm_head-sized matmuls instead of four): same outputs and gradients;
- ``polyrl reference (chunked)``: ``A.linear_logprobs_and_entropy`` (token x vocab tiles, torch matmuls): same;
- ``polyrl logits + chunked``: logits = h @ W^T (bf16 [T, V]), then ``A.logprobs_and_entropy`` (the trainer's
  path before the fused op): same;
- ``transformers-style``: logits, then fp32 log_softmax of the whole [T, V]: log-probs and entropy;
- ``liger fused linear CE``: ``LigerFusedLinearCrossEntropyLoss`` (liger-kernel), log-probs only (no entropy);
- ``cut cross-entropy``: ``cut_cross_entropy.linear_cross_entropy``, log-probs only (no entropy).
A peer that is not importable prints "not installed". polyrl's loss is Σ w·logp + 0.01·Σ entropy; the peers'
is their summed cross-entropy (= −Σ logp), so the peers do strictly less work (no entropy or its gradient).

Measured on the GPU: time = median of ``--iters`` fwd+bwd after 2 warm-up runs (CUDA events); extra peak memory =
max_memory_allocated during one fwd+bwd minus the memory allocated before it (inputs, weight and labels are
allocated before; the gradients dH and dW, which every method returns, are counted: dW alone is 1.08 GiB at
V = 201088, H = 2880 in bf16). On the CPU (``--quick --device cpu``, a toy size) only time is measured; the
Triton method runs only under TRITON_INTERPRET=1, the cuBLAS method's two Triton passes run under the interpreter
or, without it, as their torch stand-ins. After each T, each polyrl fused row is also printed as a ratio to Liger's.

Usage (H200):  python bench/logprob_linear.py                      # T = 4096 and 16384, H 2880, V 201088
CPU check:     python bench/logprob_linear.py --quick --device cpu
Writes bench/results/logprob_linear[_quick].json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

GiB = 2**30
ENT_W = 0.01  # entropy's weight in polyrl's loss (its gradient must be computed, as in DAPO/PPO with an entropy term)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _methods(device: str, chunk: int) -> dict[str, Callable | str]:
    """name -> fn(hidden, weight, labels, w) -> (scalar loss, −Σ logp), or a string saying why it cannot run."""
    from polyrl.core import algorithms as A

    out: dict[str, Callable | str] = {}
    try:
        from polyrl.backends.cuda.linear_logprobs import (
            cublas_linear_logprob_loss,
            cublas_linear_logprobs,
            triton_fused_linear_logprobs,
        )
    except ImportError as exc:
        out["polyrl fused (triton)"] = out["polyrl fused (cublas)"] = f"not importable ({exc})"
        out["polyrl fused loss (cublas)"] = f"not importable ({exc})"
    else:
        def fused_with(kernel: Callable) -> Callable:
            def fused(h, W, y, w):
                lp, ent = kernel(h, W, y, chunk_size=chunk)
                return (lp * w).sum() + ENT_W * ent.sum(), -lp.detach().sum()

            return fused

        if device == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            out["polyrl fused (triton)"] = fused_with(triton_fused_linear_logprobs)
        else:
            out["polyrl fused (triton)"] = "needs CUDA (or TRITON_INTERPRET=1)"
        out["polyrl fused (cublas)"] = fused_with(cublas_linear_logprobs)

        def fused_loss(h, W, y, w):
            def token_grad(t0, t1, lp, ent):  # d loss / d logp_t = w_t, d loss / d H_t = ENT_W
                return w[t0:t1], torch.full_like(ent, ENT_W)

            anchor, lp, ent = cublas_linear_logprob_loss(h, W, y, token_grad, chunk_size=chunk)
            return (lp * w).sum() + ENT_W * ent.sum() + anchor, -lp.sum()

        out["polyrl fused loss (cublas)"] = fused_loss

    def reference(h, W, y, w):
        lp, ent = A.linear_logprobs_and_entropy(h, W, y, chunk_size=chunk)
        return (lp * w).sum() + ENT_W * ent.sum(), -lp.detach().sum()

    def logits_chunked(h, W, y, w):
        lp, ent = A.logprobs_and_entropy(h @ W.t(), y, chunk_size=1024)
        return (lp * w).sum() + ENT_W * ent.sum(), -lp.detach().sum()

    def full_logits(h, W, y, w):
        logs = torch.log_softmax((h @ W.t()).float(), dim=-1)  # fp32 [T, V], kept for backward
        lp = logs.gather(-1, y[:, None])[:, 0]
        ent = -(logs.exp() * logs).sum(-1)
        return (lp * w).sum() + ENT_W * ent.sum(), -lp.detach().sum()

    out["polyrl reference (chunked)"] = reference
    out["polyrl logits + chunked"] = logits_chunked
    out["transformers-style (full logits)"] = full_logits
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        def liger_ce(h, W, y, w):
            loss = liger(W, h, y)
            return loss, loss.detach()

        out["liger fused linear CE"] = liger_ce
    except Exception:  # missing, or installed without its GPU dependencies
        out["liger fused linear CE"] = "not installed"
    try:
        from cut_cross_entropy import linear_cross_entropy

        def cce(h, W, y, w):
            loss = linear_cross_entropy(h, W, y, reduction="sum")
            return loss, loss.detach()

        out["cut cross-entropy"] = cce
    except Exception:
        out["cut cross-entropy"] = "not installed"
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(fn: Callable, h: torch.Tensor, W: torch.Tensor, y: torch.Tensor, w: torch.Tensor, device: str,
             iters: int) -> dict:
    def once() -> float:
        h.grad = W.grad = None
        loss, nll = fn(h, W, y, w)
        loss.backward()
        return float(nll)

    loss = once()  # warm-up (compiles Triton kernels, fills cuBLAS caches)
    if device == "cuda":
        once()
        h.grad = W.grad = None
        torch.cuda.empty_cache()
        _sync(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        once()
        _sync(device)
        extra = (torch.cuda.max_memory_allocated() - base) / GiB
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        extra = None
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            once()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(times), "extra_gib": extra, "nll": loss,
            "grad_h_norm": float(h.grad.float().norm()), "grad_w_norm": float(W.grad.float().norm())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--H", type=int, default=2880, help="GPT-OSS-20B hidden size")
    parser.add_argument("--V", type=int, default=201088, help="GPT-OSS vocabulary")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--chunk", type=int, default=2048, help="token rows per tile of polyrl's chunked passes")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="toy size (T 64 200, H 64, V 1000, 1 iteration)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.T, args.H, args.V, args.iters, args.chunk = [64, 200], 64, 1000, 1, 64
        if args.device == "cpu":
            args.dtype = "float32"  # CPU bf16 matmuls are slow and the toy run checks that everything runs
    dtype = getattr(torch, args.dtype)
    out = Path(args.out or Path(__file__).parent / "results" /
               ("logprob_linear_quick.json" if args.quick else "logprob_linear.json"))
    methods = _methods(args.device, args.chunk)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    print(f"lm_head + log-prob (+ entropy) fwd+bwd: H {args.H}, V {args.V}, {args.dtype}, {gpu}, "
          f"torch {torch.__version__}, triton {_version('triton')}, liger-kernel {_version('liger-kernel')}, "
          f"cut-cross-entropy {_version('cut-cross-entropy')}")
    rows = []
    for T in args.T:
        g = torch.Generator().manual_seed(0)
        h = (torch.randn(T, args.H, generator=g) * 2).to(dtype).to(args.device).requires_grad_()
        W = (torch.randn(args.V, args.H, generator=g) / args.H**0.5).to(dtype).to(args.device).requires_grad_()
        y = torch.randint(0, args.V, (T,), generator=g).to(args.device)
        w = torch.ones(T, device=args.device)
        results: dict[str, dict] = {}
        for name, fn in methods.items():
            if isinstance(fn, str):
                results[name] = {"skipped": fn}
                continue
            try:
                results[name] = _measure(fn, h, W, y, w, args.device, args.iters)
            except torch.OutOfMemoryError:
                results[name] = {"skipped": "out of memory"}
            h.grad = W.grad = None
            if args.device == "cuda":
                torch.cuda.empty_cache()
        ours = results.get("polyrl fused (triton)", {})
        if "ms" not in ours:
            ours = results["polyrl reference (chunked)"]
            anchor = "polyrl reference (chunked)"
        else:
            anchor = "polyrl fused (triton)"
        print(f"\nT = {T} (ratios: method / {anchor}; logp sum checks that the methods agree)")
        print(f"{'method':<34} {'ms':>9} {'extra GiB':>10} {'x time':>7} {'x mem':>7} {'-sum logp':>14}")
        for name, r in results.items():
            if "skipped" in r:
                print(f"{name:<34} {r['skipped']}")
                continue
            mem = "n/a" if r["extra_gib"] is None else f"{r['extra_gib']:.2f}"
            rmem = "n/a" if r["extra_gib"] is None or not ours.get("extra_gib") else \
                f"{r['extra_gib'] / ours['extra_gib']:.2f}"
            print(f"{name:<34} {r['ms']:>9.2f} {mem:>10} {r['ms'] / ours['ms']:>7.2f} {rmem:>7} {r['nll']:>14.8g}")
            rows.append({"T": T, "method": name, **r})
        for name, r in results.items():
            if "skipped" in r:
                rows.append({"T": T, "method": name, **r})
        liger = results.get("liger fused linear CE", {})
        for name in ("polyrl fused (triton)", "polyrl fused (cublas)", "polyrl fused loss (cublas)"):
            r = results.get(name, {})
            if "ms" in r and "ms" in liger:
                mem = "n/a" if r["extra_gib"] is None or not liger.get("extra_gib") else \
                    f"{r['extra_gib'] / liger['extra_gib']:.2f}x"
                print(f"{name} / liger fused linear CE: {r['ms'] / liger['ms']:.2f}x time, {mem} memory "
                      "(polyrl with entropy, Liger without)")
        del h, W, y, w
    meta = {"H": args.H, "V": args.V, "dtype": args.dtype, "device": gpu, "chunk": args.chunk, "iters": args.iters,
            "torch": torch.__version__, "triton": _version("triton"), "liger-kernel": _version("liger-kernel"),
            "cut-cross-entropy": _version("cut-cross-entropy"), "date": time.strftime("%Y-%m-%d"),
            "entropy_weight": ENT_W}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
