"""Attention benchmark on one GPU: polyrl's Triton varlen attention beside SDPA, flex_attention and eager.

GPT-OSS shape (64 q / 8 kv heads, head_dim 64), bf16, 16k tokens packed as 4 documents of 4096 and as one
document, window None and 128, sinks on. For each case and implementation: forward and forward+backward ms
(triton.testing.do_bench, median), useful TFLOP/s (only visible (query, key) pairs count), peak memory of one
forward+backward, and accuracy against an fp32 reference (relative norm) for ours. REFERENCE.md §8 anchors
(H200) are printed beside our figures. FLA / FlashAttention-4 run when importable.

    python bench/attention.py [--tokens 16384] [--out bench/results/attention.json] [--skip-eager]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import sys
import time

import torch

HQ, HKV, D = 64, 8, 64
# REFERENCE §8, H200, packed 16k tokens, sinks on: (fwd ms, fwd+bwd ms).
ANCHORS = {
    ("4x4096", None): {"FA4": (1.46, 4.69), "FLA": (1.82, 10.13), "flex": (2.13, 8.40), "cuDNN-nosink": (1.24, 5.06)},
    ("4x4096", 128): {"FA4": (0.50, 1.59), "FLA": (0.83, 3.70), "flex": (0.99, 3.52)},
    ("1x16384", None): {"FA4": (4.25, 15.2), "FLA": (5.92, 32.2), "flex": (6.36, 25.6)},
    ("1x16384", 128): {"FA4": (0.59, 1.66), "FLA": (0.84, 3.81), "flex": (1.00, 3.54)},
}
TARGETS = {("4x4096", None): (1.3, 4.2), ("4x4096", 128): (0.15, 0.5)}


def useful_flops(lengths: list[int], window: int | None) -> float:
    """Forward FLOPs over visible pairs only: 2 matmuls x 2 FLOP x D per (query, key, head)."""
    pairs = 0
    for n in lengths:
        if window is None:
            pairs += n * (n + 1) // 2
        else:
            w = min(window, n)
            pairs += w * (w + 1) // 2 + (n - w) * w
    return 4.0 * pairs * D * HQ


def bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# --- implementations: each returns (fwd callable, fwd+bwd callable) over the shared packed inputs ----------
def impl_polyrl(q, k, v, sinks, cu, lengths, window):
    from polyrl.backends.cuda.attention import triton_varlen_attention

    scale = D**-0.5

    def fwd():
        return triton_varlen_attention(q, k, v, cu, scale=scale, window=window, sinks=sinks)

    return fwd


def impl_sdpa(q, k, v, sinks, cu, lengths, window):
    """cuDNN / flash SDPA, batched documents, causal, NO sink and no window: the upper bound."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if len(set(lengths)) != 1:
        raise RuntimeError("batched SDPA needs equal document lengths")
    b, n = len(lengths), lengths[0]
    qb = q.view(b, n, HQ, D).transpose(1, 2)
    kb = k.repeat_interleave(HQ // HKV, 1).view(b, n, HQ, D).transpose(1, 2).detach().requires_grad_()
    vb = v.repeat_interleave(HQ // HKV, 1).view(b, n, HQ, D).transpose(1, 2).detach().requires_grad_()

    def fwd():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
            return out.transpose(1, 2).reshape(b * n, HQ, D)

    return fwd, (qb, kb, vb)


_FLEX = {}


def impl_flex(q, k, v, sinks, cu, lengths, window):
    """flex_attention with a document(+window) block mask; the sink through the differentiable LSE."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX["fn"]
    t = q.shape[0]
    doc = torch.searchsorted(cu[1:].long(), torch.arange(t, device=q.device), right=True)

    def mask_mod(b, h, qi, kj):
        ok = (doc[qi] == doc[kj]) & (kj <= qi)
        if window is not None:
            ok = ok & (qi - kj < window)
        return ok

    bm = create_block_mask(mask_mod, None, None, t, t, device=q.device)
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))

    def fwd():
        out, lse = flex(q4, k4, v4, block_mask=bm, enable_gqa=True, return_lse=True)
        out = out * torch.sigmoid(lse - sinks.view(1, -1, 1)).unsqueeze(-1).to(out.dtype)
        return out.squeeze(0).transpose(0, 1)

    return fwd


def impl_eager(q, k, v, sinks, cu, lengths, window):
    """What transformers' eager GPT-OSS attention does: dense logits, the sink as an extra column."""
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]

    def fwd():
        outs = []
        for a, b in itertools.pairwise(bounds):
            n = b - a
            qd = q[a:b].transpose(0, 1)
            kd = k[a:b].repeat_interleave(HQ // HKV, 1).transpose(0, 1)
            vd = v[a:b].repeat_interleave(HQ // HKV, 1).transpose(0, 1)
            logits = qd @ kd.transpose(1, 2) * D**-0.5
            i = torch.arange(n, device=q.device)
            allowed = i[None, :] <= i[:, None]
            if window is not None:
                allowed = allowed & (i[:, None] - i[None, :] < window)
            logits = logits.masked_fill(~allowed, float("-inf"))
            logits = torch.cat([logits, sinks.view(-1, 1, 1).expand(-1, n, 1).to(logits.dtype)], -1)
            probs = torch.softmax(logits - logits.amax(-1, keepdim=True), -1, dtype=torch.float32)[..., :-1]
            outs.append((probs.to(vd.dtype) @ vd).transpose(0, 1))
        return torch.cat(outs)

    return fwd


def impl_fla(q, k, v, sinks, cu, lengths, window):
    from fla.ops.attn import parallel_attn  # optional peer

    def fwd():
        return parallel_attn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale=D**-0.5, cu_seqlens=cu.long(),
                             window_size=window, sink_bias=sinks).squeeze(0)

    return fwd


def impl_fa4(q, k, v, sinks, cu, lengths, window):
    from flash_attn.cute import flash_attn_varlen_func  # optional peer

    n = max(lengths)

    def fwd():
        out = flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True, learnable_sink=sinks,
                                     window_size=(window - 1, 0) if window else (None, None))
        return out[0] if isinstance(out, tuple) else out

    return fwd


IMPLS = {"polyrl": impl_polyrl, "sdpa-nosink": impl_sdpa, "flex": impl_flex, "eager": impl_eager,
         "fla": impl_fla, "fa4": impl_fa4}


def run_case(layout: str, window: int | None, impls: list[str], accuracy: bool) -> list[dict]:
    n_docs, n = (int(x) for x in layout.split("x"))
    lengths = [n] * n_docs
    t = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    k = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    v = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    sinks = (torch.randn(HQ, device="cuda", generator=gen) + 1.0).requires_grad_()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    do = torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    flops = useful_flops(lengths, window)
    rows = []
    for name in impls:
        row = {"layout": layout, "window": window, "impl": name, "sinks": name != "sdpa-nosink"}
        try:
            made = IMPLS[name](q, k, v, sinks, cu, lengths, window)
            fwd, leaves = made if isinstance(made, tuple) else (made, (q, k, v, sinks))
            if name == "sdpa-nosink" and window is not None:
                raise RuntimeError("SDPA has no sliding window")

            def fwd_bwd(fwd=fwd, leaves=leaves):
                out = fwd()
                torch.autograd.grad(out, leaves, do, allow_unused=True)

            with torch.no_grad():
                row["fwd_ms"] = bench_ms(fwd)
            row["fwd_bwd_ms"] = bench_ms(fwd_bwd)
            row["peak_gib"] = round(peak_gib(fwd_bwd), 3)
            row["fwd_tflops"] = round(flops / row["fwd_ms"] / 1e9, 1)
            row["fwd_bwd_tflops"] = round(3.5 * flops / row["fwd_bwd_ms"] / 1e9, 1)
            if accuracy and name in ("polyrl", "fla", "fa4"):
                row.update(accuracy_vs_fp32(fwd, q, k, v, sinks, cu, window, do))
        except ImportError as e:
            row["error"] = f"not installed: {e}"
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
        except Exception as e:  # a peer failing must not hide the others' numbers
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def accuracy_vs_fp32(fwd, q, k, v, sinks, cu, window, do) -> dict:
    """bf16 kernel vs the fp32 reference on the same (bf16-rounded) inputs: relative norm of out and grads."""
    from polyrl.core.reference_attention import reference_varlen_attention

    out = fwd()
    grads = torch.autograd.grad(out, (q, k, v, sinks), do)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v, sinks)]
    ref = reference_varlen_attention(*leaves[:3], cu, scale=D**-0.5, window=window, sinks=leaves[3])
    ref_grads = torch.autograd.grad(ref, leaves, do.float())
    names = ("dq", "dk", "dv", "dsink")
    res = {"err_out": rel(out, ref)}
    res.update({f"err_{n}": rel(g, r) for n, g, r in zip(names, grads, ref_grads)})
    return {k_: float(f"{v_:.2e}") for k_, v_ in res.items()}


def versions() -> dict:
    import transformers
    import triton

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def print_table(rows: list[dict]) -> None:
    print(f"\n{'layout':8} {'window':6} {'impl':12} {'fwd ms':>8} {'f+b ms':>8} {'fwd TF':>7} {'f+b TF':>7} "
          f"{'peak GiB':>8}  anchors (fwd / f+b ms)")
    for r in rows:
        anc = ANCHORS.get((r["layout"], r["window"]), {})
        tgt = TARGETS.get((r["layout"], r["window"]))
        anchor = "  ".join(f"{k} {a[0]}/{a[1]}" for k, a in anc.items()) if r["impl"] == "polyrl" else ""
        if tgt and r["impl"] == "polyrl":
            anchor = f"target {tgt[0]}/{tgt[1]}  " + anchor
        if "error" in r:
            print(f"{r['layout']:8} {r['window']!s:6} {r['impl']:12} {r['error']}")
            continue
        print(f"{r['layout']:8} {r['window']!s:6} {r['impl']:12} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:8.3f} "
              f"{r['fwd_tflops']:7.0f} {r['fwd_bwd_tflops']:7.0f} {r['peak_gib']:8.2f}  {anchor}")
        if "err_out" in r:
            errs = " ".join(f"{k[4:]} {v:.1e}" for k, v in r.items() if k.startswith("err_"))
            print(f"{'':29}accuracy vs fp32 (rel. norm; FA4/FLA: out 2.0e-3, grads <= 3.4e-3): {errs}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="4x4096,1x16384")
    ap.add_argument("--windows", default="none,128")
    ap.add_argument("--impls", default="polyrl,sdpa-nosink,flex,eager,fla,fa4")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--out", default="bench/results/attention.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    t0 = time.time()
    for layout in args.layouts.split(","):
        for w in args.windows.split(","):
            window = None if w == "none" else int(w)
            rows += run_case(layout, window, args.impls.split(","), accuracy=not args.no_accuracy)
    result = {"versions": versions(), "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "dtype": "bfloat16"},
              "anchors_ms": {f"{k[0]}/{k[1]}": v for k, v in ANCHORS.items()}, "rows": rows,
              "wall_s": round(time.time() - t0, 1)}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print_table(rows)
    print(json.dumps(result["versions"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
