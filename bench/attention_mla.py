"""DeepSeek-V3's attention layout on one GPU: polyrl's Triton kernel beside FlashAttention-4, to decide which one the
cuda backend runs there.

The layout the trainer hands the attention slot for DeepSeek-V3 (multi-head latent attention in its training form,
keys and values expanded per head): 128 query heads and 128 kv heads, query / key head dim 192 (128 + 64 rotary),
value head dim 128, no sinks, full causal; bf16, 16k tokens packed as 4 x 4096 and as 1 x 16384. The cuda backend's
rule (polyrl.backends.cuda.attention_choice) runs the Triton kernel at head dims 192 / 128 because FA4 was never
measured there; this measures both in one process and prints the ``Measurement`` row to record:

- ``polyrl``: ``triton_varlen_attention`` (192 runs padded to 256 in the QK^T / dQ / dK products, kernels/README.md);
- ``fa4``: polyrl's FA4 wrapper as the backend would run it (``fa4_varlen_attention``: deterministic backward by
  default, ``POLYRL_FA4_DETERMINISTIC``);
- ``fa4-direct``: ``flash_attn.cute.flash_attn_varlen_func`` with its own default (non-deterministic dQ);
- ``polyrl-selected``: the backend's slot as the trainer calls it (which of the above its rule picks, printed).

Forward and forward + backward ms (``triton.testing.do_bench``, median), useful TFLOP/s, and each implementation's
error against an fp32 reference on a small case (1 x 1024, the same heads and dims: relative norm of out, dq, dk,
dv). Ours beside each FA4 figure of the same run, and the ratio.

    python bench/attention_mla.py [--layouts 4x4096,1x16384] [--heads 128] [--out bench/results/attention_mla.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

D, DV = 192, 128
IMPLS = ("polyrl", "polyrl-selected", "fa4", "fa4-direct")
# polyrl's varlen attention entry points, all called as fn(q, k, v, cu, scale=, window=, sinks=)
POLYRL_FNS = {"polyrl": ("polyrl.backends.cuda.attention", "triton_varlen_attention"),
              "polyrl-selected": ("polyrl.backends.cuda.attention", "cuda_varlen_attention"),
              "fa4": ("polyrl.backends.cuda.fa4", "fa4_varlen_attention")}


def make_case(layout: str, heads: int, *, device: str = "cuda", dtype=None, d: int = D, dv: int = DV, seed: int = 0):
    """bf16 leaves q [T, H, d], k [T, H, d], v [T, H, dv] (requires_grad), int32 cu_seqlens, the longest document,
    and an upstream gradient [T, H, dv]."""
    import torch

    dtype = dtype or torch.bfloat16
    n, length = parse_layout(layout)
    t = n * length
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(device, dtype)

    q = rand(t, heads, d, s=0.5).requires_grad_()
    k = rand(t, heads, d, s=0.5).requires_grad_()
    v = rand(t, heads, dv).requires_grad_()
    cu = torch.arange(0, t + 1, length, dtype=torch.int32, device=device)
    return q, k, v, cu, length, rand(t, heads, dv)


def parse_layout(layout: str) -> tuple[int, int]:
    try:
        n, length = (int(x) for x in layout.lower().split("x"))
    except ValueError:
        raise ValueError(f"layout {layout!r}: expected DOCSxTOKENS, e.g. 4x4096") from None
    if n < 1 or length < 1:
        raise ValueError(f"layout {layout!r}: documents and tokens must be positive")
    return n, length


def implementation(name: str, longest: int):
    """fn(q, k, v, cu) -> out for one implementation (module docstring)."""
    if name in POLYRL_FNS:
        module, func = POLYRL_FNS[name]
        fn = getattr(importlib.import_module(module), func)
        return lambda q, k, v, cu: fn(q, k, v, cu, scale=q.shape[-1] ** -0.5, window=None, sinks=None)
    if name == "fa4-direct":
        from flash_attn.cute import flash_attn_varlen_func

        return lambda q, k, v, cu: flash_attn_varlen_func(
            q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
            softmax_scale=q.shape[-1] ** -0.5, causal=True)[0]
    raise ValueError(f"unknown implementation {name!r}; known: {', '.join(IMPLS)}")


def useful_tflop(layout: str, heads: int, fwd_bwd: bool, d: int = D, dv: int = DV) -> float:
    """FLOP over the visible (query, key) pairs: QK^T (d) and PV (dv) forward; the backward adds dV (dv), dP (dv),
    dQ (d) and dK (d)."""
    n, length = parse_layout(layout)
    pairs = n * heads * length * (length + 1) / 2
    per_pair = 2 * (d + dv) + (2 * (dv + dv + d + d) if fwd_bwd else 0)
    return pairs * per_pair / 1e12


def measure(layout: str, heads: int, impls: list[str], *, device: str = "cuda", dtype=None, do_bench=None,
            d: int = D, dv: int = DV) -> list[dict]:
    """One layout: each implementation's fwd and fwd+bwd ms, or the reason it did not run."""
    import torch

    if do_bench is None:
        from triton.testing import do_bench
    q, k, v, cu, longest, do = make_case(layout, heads, device=device, dtype=dtype, d=d, dv=dv)
    rows = []
    for name in impls:
        row = {"layout": layout, "impl": name}
        try:
            fn = implementation(name, longest)
            if name == "polyrl-selected":
                from polyrl.backends.cuda.attention_choice import choose

                row["choice"] = str(choose(q, v, None, None))
            fn(q, k, v, cu)  # compile outside the timing

            def fwd_bwd(fn=fn):
                torch.autograd.grad(fn(q, k, v, cu), (q, k, v), do)

            with torch.no_grad():
                row["fwd_ms"] = do_bench(lambda fn=fn: fn(q, k, v, cu))
            row["fwd_bwd_ms"] = do_bench(fwd_bwd)
            row["fwd_tflops"] = useful_tflop(layout, heads, False, d, dv) / (row["fwd_ms"] / 1e3)
            row["fwd_bwd_tflops"] = useful_tflop(layout, heads, True, d, dv) / (row["fwd_bwd_ms"] / 1e3)
        except ImportError as exc:
            row["skipped"] = f"not installed ({exc.name or exc})"
        except Exception as exc:  # one implementation failing must not lose the others' figures
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        rows.append(row)
        print(_row_line(row), flush=True)
    return rows


def accuracy(heads: int, impls: list[str], *, device: str = "cuda", dtype=None, layout: str = "1x1024",
             d: int = D, dv: int = DV) -> dict[str, dict[str, float]]:
    """Relative error norms of out, dq, dk, dv against the fp32 reference attention, per implementation."""
    import torch

    from polyrl.core.attention.reference import reference_varlen_attention

    q, k, v, cu, longest, do = make_case(layout, heads, device=device, dtype=dtype, d=d, dv=dv, seed=1)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref_out = reference_varlen_attention(*leaves, cu, scale=d**-0.5, window=None, sinks=None)
    ref = dict(zip(("out", "dq", "dk", "dv"), (ref_out, *torch.autograd.grad(ref_out, leaves, do.float()))))
    errors = {}
    for name in impls:
        try:
            out = implementation(name, longest)(q, k, v, cu)
            got = dict(zip(("out", "dq", "dk", "dv"), (out, *torch.autograd.grad(out, (q, k, v), do))))
        except Exception:  # reported by measure()
            continue
        errors[name] = {key: float((got[key].detach().double() - ref[key].detach().double()).norm()
                                      / ref[key].detach().double().norm())
                        for key in ref}
    return errors


def _row_line(row: dict) -> str:
    head = f"{row['layout']:>8s} {row['impl']:16s}"
    if "fwd_ms" in row:
        text = (f"{head} fwd {row['fwd_ms']:8.3f} ms ({row['fwd_tflops']:5.0f} TFLOP/s)   fwd+bwd "
                f"{row['fwd_bwd_ms']:8.3f} ms ({row['fwd_bwd_tflops']:5.0f} TFLOP/s)")
        return text + (f"   runs: {row['choice']}" if "choice" in row else "")
    return f"{head} {row.get('skipped') or row.get('error')}"


def comparison(rows: list[dict]) -> list[str]:
    """Ours beside each FA4 figure of the same layout, the ratio (below 1: ours is faster), and the Measurement
    row for polyrl.backends.cuda.attention_choice.MEASURED."""
    lines = []
    by = {(r["layout"], r["impl"]): r for r in rows if "fwd_ms" in r}
    for layout in dict.fromkeys(r["layout"] for r in rows):
        ours = by.get((layout, "polyrl"))
        for peer in ("fa4", "fa4-direct"):
            theirs = by.get((layout, peer))
            if ours and theirs:
                lines.append(f"{layout}: polyrl {ours['fwd_ms']:.3f} / {ours['fwd_bwd_ms']:.3f} ms, {peer} "
                             f"{theirs['fwd_ms']:.3f} / {theirs['fwd_bwd_ms']:.3f} ms, ratio "
                             f"{ours['fwd_ms'] / theirs['fwd_ms']:.2f} / {ours['fwd_bwd_ms'] / theirs['fwd_bwd_ms']:.2f}")
        fa4 = by.get((layout, "fa4"))
        if ours and fa4:
            lines.append(f'    Measurement("{layout}", None, ({D}, {DV}), triton_ms=({ours["fwd_ms"]:.3f}, '
                         f'{ours["fwd_bwd_ms"]:.3f}), fa4_ms=({fa4["fwd_ms"]:.3f}, {fa4["fwd_bwd_ms"]:.3f})),')
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="4x4096,1x16384")
    ap.add_argument("--heads", type=int, default=128, help="query = kv heads (DeepSeek-V3: 128)")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--out", default="bench/results/attention_mla.json")
    args = ap.parse_args(argv)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        print(f"attention_mla: unknown implementation(s) {', '.join(unknown)}; known: {', '.join(IMPLS)}",
              file=sys.stderr)
        return 2
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    try:
        for layout in layouts:
            parse_layout(layout)
    except ValueError as exc:
        print(f"attention_mla: --layouts: {exc}", file=sys.stderr)
        return 2
    if args.heads < 1:
        print(f"attention_mla: --heads {args.heads}: at least 1", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("attention_mla: needs a CUDA GPU (FA4 and the Triton kernel compiled for it)", file=sys.stderr)
        return 2
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "/tmp/fa4_cute_dsl_cache")
    t0 = time.time()
    print(f"DeepSeek-V3 attention: {args.heads} q / {args.heads} kv heads, head dims {D} / {DV}, bf16, causal, "
          "no sinks", flush=True)
    rows = [row for layout in layouts for row in measure(layout, args.heads, impls)]
    errors = {} if args.no_accuracy else accuracy(args.heads, impls)
    for name, err in errors.items():
        print(f"accuracy vs fp32 (1x1024) {name:16s} " + ", ".join(f"{k} {v:.1e}" for k, v in err.items()))
    lines = comparison(rows)
    print("\n".join(lines))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from attention import versions  # GPU, torch / triton / transformers and the peers' versions, as attention.py

    result = {"versions": versions(), "shape": {"heads": args.heads, "D": D, "Dv": DV, "dtype": "bfloat16",
                                                "sinks": False, "causal": True},
              "rows": rows, "accuracy_vs_fp32": errors, "comparison": lines, "wall_s": round(time.time() - t0, 1)}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}; wall {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
