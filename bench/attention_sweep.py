"""Launch-config sweep of the cuda backend's Triton attention kernels (forward, dQ, dK/dV) on GPT-OSS shapes.

Each kernel is timed alone (``triton.testing.do_bench``) for every candidate config in CANDIDATES, on the saved
tensors of one real forward (so the backward kernels see the real LSE, O and dO), and each candidate's outputs are
compared with the current default config's (the first config of polyrl.backends.cuda.kernels.configs): a
candidate whose outputs differ by more than bf16 rounding is marked ``WRONG`` and never picked. Printed per
layout: every candidate's ms, its ratio to the default, and the best; with FA4 importable, FA4's fwd and fwd+bwd
from the same process beside the default's and the best configs' sum, and the ratios.

    python bench/attention_sweep.py [--layouts 4x4096,1x16384] [--windows none] [--kernels fwd,dq,dkdv]
                                    [--variants-only] [--variants heads-inner,...]
                                    [--out bench/results/attention_sweep.json]

Why a sweep and not ``POLYRL_TRITON_AUTOTUNE=1``: the autotuner prints only its pick, not the table of all
candidates, and it cannot flag a config whose result is wrong. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M counts (token, head-of-the-group) rows: at GPT-OSS's
# G = 8, BLOCK_M = 64 is 8 tokens. The first row of each list is today's default (configs.py), kept first.
CANDIDATES: dict[str, list[tuple[int, int, int, int]]] = {
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (128, 128, 8, 2),
            (128, 64, 4, 4), (256, 64, 8, 3), (256, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3)],
    "dq": [(128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (128, 32, 4, 4), (128, 128, 8, 2),
           (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (256, 64, 8, 2), (256, 64, 8, 3), (256, 32, 8, 3)],
    "dkdv": [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3), (32, 128, 4, 3), (32, 128, 4, 4), (32, 128, 8, 4),
             (64, 128, 8, 2), (64, 128, 8, 3), (64, 128, 4, 3), (16, 128, 4, 4), (128, 128, 8, 2), (128, 64, 8, 3),
             # 128 resident keys that compile without spills for sm_90 (bench/kernel_resources.py, Triton 3.6.0):
             # 244 / 255 / 219 registers, 0 stack bytes; timed on an H200 (2026-12-07): the last is the Hopper pick
             (16, 128, 4, 2), (32, 128, 4, 1), (64, 128, 8, 1)],
}
H_Q, H_KV, HEAD_DIM = 64, 8, 64


# The kernels' variants beside the launch config (name -> constexpr flags), swept on the first candidates: the
# forward and dQ start their heaviest (last) q tiles first; dK/dV loads the next q tile before this one's matmuls
# (prefetch); each kernel can load the tiles it walks over (K/V for the forward and dQ, q/dO for dK/dV) through TMA
# descriptors into shared memory (tma: no per-element addresses in registers; polyrl.backends.cuda.tma).
VARIANTS: dict[str, dict[str, dict[str, bool]]] = {
    "fwd": {"heavy-first": {"HEAVY_FIRST": True}, "tma": {"TMA": True},
            "tma-heavy-first": {"TMA": True, "HEAVY_FIRST": True}},
    "dq": {"heavy-first": {"HEAVY_FIRST": True}, "tma": {"TMA": True},
           "tma-heavy-first": {"TMA": True, "HEAVY_FIRST": True}},
    "dkdv": {"prefetch": {"PREFETCH": True}, "tma": {"TMA": True},
             # the launch with the kv heads fastest (bench/launch_tail.py), against the default (key blocks fastest)
             "heads-inner": {"HEADS_INNER": True}, "prefetch-heads-inner": {"PREFETCH": True, "HEADS_INNER": True}},
}
VARIANT_FIRST = 4  # how many of a kernel's first candidates are swept with each variant, unless listed here:
VARIANT_CANDIDATES: dict[str, dict[str, list[tuple[int, int, int, int]]]] = {
    # TMA loads: the tiles that compile for sm_90 without spills (bench/kernel_resources.py, Triton 3.6.0; the
    # forward's first config drops from 255 to 207 registers, dQ's Hopper pick from 255 + 16 spilled bytes to 254).
    # Heavy-first: on the first candidates (H200, 97987a2) it took 0.97x-0.99x the forward's time and 0.96x-0.99x
    # dQ's (one config 1.015x), as bench/launch_tail.py's model of the launch expects (a 3-4% tail without it); the
    # picks since were measured without it, so it is swept on the picks (the forward's with its TMA loads).
    "fwd": {"heavy-first": [],
            "tma": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 4),
                    (256, 64, 8, 3), (64, 128, 4, 3)],
            "tma-heavy-first": [(128, 64, 8, 3), (128, 64, 4, 3)]},
    "dq": {"heavy-first": [(256, 64, 8, 3)],
           "tma": [(256, 64, 8, 3), (256, 64, 8, 2), (256, 32, 8, 3), (128, 64, 8, 3), (128, 32, 4, 3),
                   (128, 128, 8, 2), (128, 128, 8, 3), (64, 128, 4, 3)],
           "tma-heavy-first": [(64, 128, 4, 3)]},
    "dkdv": {
        # the Hopper pick (configs.HOPPER_PICKS) and the tiles whose prefetching code compiles for sm_90 without
        # spills (Triton 3.6.0: 235 / 247 / 255 / 205 / 187 registers, 0 stack bytes; 64-row two-stage and 32-row
        # 128-key one-stage tiles spill with it)
        "prefetch": [(64, 128, 8, 1), (64, 64, 4, 1), (64, 128, 8, 2), (32, 64, 4, 2), (32, 64, 4, 1)],
        # 143-242 registers, no spills (32 rows x 128 keys on 4 warps spills)
        "tma": [(64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 1), (64, 128, 8, 2),
                (64, 128, 8, 3), (32, 64, 4, 2), (32, 64, 4, 3), (32, 128, 8, 2), (32, 128, 8, 3)],
        # kv heads fastest on the first config, the Hopper pick and the 128-key tiles, whose fewer programs (one per
        # SM at 8 warps) leave the longest tail in key-block order (bench/launch_tail.py)
        "heads-inner": [(64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 8, 3)],
        "prefetch-heads-inner": [(64, 64, 4, 1), (64, 128, 8, 1)],
    },
}


def config_label(cfg: tuple[int, int, int, int], variant: str = "") -> str:
    """How a candidate is named in the printed table and the JSON: ``M128 N64 w4 s3`` (+ `` prefetch`` etc.,
    the kernel's variant of VARIANTS)."""
    m, n, w, s = cfg
    return f"M{m} N{n} w{w} s{s}" + (f" {variant}" if variant else "")


def sweep_rows(kernel: str, cands: list[tuple[int, int, int, int]], listed: bool = True) -> list[tuple[tuple, str]]:
    """(config, variant name) pairs swept for one kernel: every candidate alone, then each variant on its listed
    candidates (VARIANT_CANDIDATES, when ``listed``; an empty list skips the variant) or on the first VARIANT_FIRST
    candidates."""
    rows = [(c, "") for c in cands]
    for name in VARIANTS.get(kernel, {}):
        chosen = VARIANT_CANDIDATES.get(kernel, {}).get(name) if listed else None
        rows += [(c, name) for c in (cands[:VARIANT_FIRST] if chosen is None else chosen)]
    return rows


def _case(layout: str, window: int | None, device: str = "cuda", dtype=None):
    import torch

    dtype = dtype or torch.bfloat16

    n, L = (int(x) for x in layout.split("x"))
    T = n * L
    g = torch.Generator(device="cpu").manual_seed(0)
    q = (torch.randn(T, H_Q, HEAD_DIM, generator=g) * 0.5).to(device, dtype).requires_grad_()
    k = (torch.randn(T, H_KV, HEAD_DIM, generator=g) * 0.5).to(device, dtype).requires_grad_()
    v = torch.randn(T, H_KV, HEAD_DIM, generator=g).to(device, dtype).requires_grad_()
    sinks = torch.randn(H_Q, generator=g).to(device, dtype).requires_grad_()
    cu = torch.arange(0, T + 1, L, dtype=torch.int32, device=device)
    do = torch.randn(T, H_Q, HEAD_DIM, generator=g).to(device, dtype)
    return q, k, v, sinks, cu, do, window


def default_and_pick(kernel: str, window: int | None, first: tuple[int, int, int, int]) -> list[tuple[tuple, str]]:
    """A kernel that is not swept: its default (first candidate) and, where configs.HOPPER_PICKS has one for
    GPT-OSS heads, its Hopper pick with the pick's variant, so the sums of the other kernels' rows stay those of
    the code the backend runs."""
    from polyrl.backends.cuda.kernels.configs import HOPPER_PICKS, head_dim_class

    rows = [(first, "")]
    pick = HOPPER_PICKS.get((kernel, head_dim_class(HEAD_DIM, HEAD_DIM), window is not None))
    if pick is not None:
        m, n, w, s, *flags = pick
        variant = next((name for name, f in VARIANTS[kernel].items() if flags and f == flags[0]), "")
        if ((m, n, w, s), variant) != rows[0]:
            rows.append(((m, n, w, s), variant))
    return rows


def sweep_layout(layout: str, window: int | None, *, device: str = "cuda", dtype=None, do_bench=None,
                 candidates: dict | None = None, kernels: list[str] | None = None,
                 variants_only: bool = False, variant_names: list[str] | None = None) -> dict:
    """One layout's sweep (module docstring). ``kernels``: the kernels swept (all by default); the others run their
    default and Hopper pick only (``default_and_pick``). ``variants_only``: a swept kernel runs its default and
    Hopper pick, then its variants' listed tiles, and not its other plain candidates. ``variant_names``: only these
    variants' rows (of any kernel swept; the default and the Hopper pick still run). ``device`` / ``dtype`` /
    ``do_bench`` / ``candidates``: for the CPU check of this script under TRITON_INTERPRET=1
    (tests/cuda/test_attention_sweep_interpret.py)."""
    import torch
    import triton

    if do_bench is None:
        from triton.testing import do_bench
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    from polyrl.backends.cuda.attention import LOG2E, KernelOptions, triton_varlen_attention
    from polyrl.backends.cuda.kernels.backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, bwd_preprocess_kernel
    from polyrl.backends.cuda.kernels.forward import attn_fwd_kernel
    from polyrl.backends.cuda.tma import ensure_allocator

    q, k, v, sinks, cu, do, window = _case(layout, window, device, dtype)
    options = KernelOptions()
    scale = HEAD_DIM ** -0.5
    out = triton_varlen_attention(q, k, v, cu, scale=scale, window=window, sinks=sinks, options=options)
    qs, ks, vs, o, lse, doc_start, doc_end, _s = out.grad_fn.saved_tensors
    T = qs.shape[0]
    G = H_Q // H_KV
    G_P = triton.next_power_of_2(G)
    W = int(window) if window is not None else 0
    band = options.band(window)
    delta = torch.empty((T, H_Q), device=q.device, dtype=torch.float32)
    bwd_preprocess_kernel[(triton.cdiv(T * H_Q, 64),)](o, do, delta, T * H_Q, o.stride(1), do.stride(1),
                                                        DV=HEAD_DIM, BLOCK_R=64, BLOCK_DV=HEAD_DIM)
    common = dict(D=HEAD_DIM, DV=HEAD_DIM, G_P=G_P, BLOCK_D=HEAD_DIM, BLOCK_DV=HEAD_DIM, HAS_WINDOW=window is not None,
                  DOT_PREC="tf32" if q.dtype != torch.float32 else "ieee", BAND=band)
    sink_arg = sinks.detach().float().contiguous()

    if device == "cuda":
        ensure_allocator()  # kernel scratch for the TMA variant's descriptors

    def run(kernel: str, cfg: tuple[int, int, int, int], variant: str = ""):
        m, n, w, s = cfg
        flags = VARIANTS[kernel].get(variant, {}) if variant else {}
        heavy_first = flags.get("HEAVY_FIRST", False)
        launch = dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
        if kernel == "fwd":
            o2 = torch.empty_like(o)
            lse2 = torch.empty_like(lse)
            args = (qs, ks, vs, o2, lse2, sink_arg, doc_start, T, W, G, scale * LOG2E, qs.stride(0), qs.stride(1),
                    ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), o2.stride(0), o2.stride(1), H_Q)

            def go():
                attn_fwd_kernel.fn[(triton.cdiv(T, m // G_P), H_KV)](
                    *args, **common, HAS_SINK=True, HEAVY_FIRST=heavy_first, TMA=flags.get("TMA", False), **launch)
            return go, (o2, lse2)
        if kernel == "dq":
            dq = torch.empty_like(qs)
            d_exact = torch.empty_like(delta)
            args = (qs, ks, vs, do, lse, delta, dq, doc_start, d_exact, T, W, G, scale * LOG2E, scale,
                    qs.stride(0), qs.stride(1), ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
                    do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), H_Q)

            def go():
                attn_bwd_dq_kernel.fn[(triton.cdiv(T, m // G_P), H_KV)](
                    *args, **common, HEAVY_FIRST=heavy_first, TMA=flags.get("TMA", False), **launch)
            return go, (dq, d_exact)
        dk, dv = torch.empty_like(ks), torch.empty_like(vs)
        args = (qs, ks, vs, do, lse, delta, dk, dv, doc_start, doc_end, T, W, G, scale * LOG2E, scale,
                qs.stride(0), qs.stride(1), ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
                do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), H_Q)

        def go():
            attn_bwd_dkdv_kernel.fn[(triton.cdiv(T, n) * H_KV,)](*args, **common, **flags, **launch)
        return go, (dk, dv)

    result: dict = {"layout": layout, "window": window, "kernels": {}}
    for kernel, cands in (candidates or CANDIDATES).items():
        if kernels is None or kernel in kernels:
            variants = sweep_rows(kernel, cands, listed=candidates is None)
            if variant_names is not None:
                variants = [row for row in variants if not row[1] or row[1] in variant_names]
            if variants_only or variant_names is not None:  # the default and the pick first, then the rest asked
                plain = default_and_pick(kernel, window, cands[0])
                variants = plain + [row for row in variants if row not in plain and (row[1] or not variants_only)]
        else:
            variants = default_and_pick(kernel, window, cands[0])
        ref = None
        rows = []
        for cfg, variant in variants:
            label = config_label(cfg, variant)
            try:
                go, outs = run(kernel, cfg, variant)
                go()
                sync()
                ms = do_bench(go, warmup=25, rep=100)
            except Exception as exc:
                print(f"  {layout} w={window} {kernel:5s} {label:28s} failed: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:100]}", flush=True)
                rows.append({"config": label, "ms": None, "error": type(exc).__name__})
                continue
            if ref is None:
                ref = [x.float().clone() for x in outs]
                err = 0.0
            else:
                err = max(float((x.float() - r).abs().max() / r.abs().max().clamp(min=1e-6))
                          for x, r in zip(outs, ref))
            ok = err <= 2e-2
            rows.append({"config": label, "ms": ms, "max_rel_diff_vs_default": err, "ok": ok})
            print(f"  {layout} w={window} {kernel:5s} {label:28s} {ms:8.3f} ms  x{ms / rows[0]['ms']:.3f} of default"
                  f"{'' if ok else f'  WRONG (diff {err:.1e})'}", flush=True)
        good = [r for r in rows if r.get("ms") is not None and r["ok"]]
        best = min(good, key=lambda r: r["ms"])
        result["kernels"][kernel] = {"rows": rows, "default": rows[0], "best": best}
        print(f"{layout} w={window} {kernel}: default {rows[0]['ms']:.3f} ms, best {best['config']} "
              f"{best['ms']:.3f} ms (x{best['ms'] / rows[0]['ms']:.3f})", flush=True)
    kern = result["kernels"]
    pre = do_bench(lambda: bwd_preprocess_kernel[(triton.cdiv(T * H_Q, 64),)](
        o, do, delta, T * H_Q, o.stride(1), do.stride(1), DV=HEAD_DIM, BLOCK_R=64, BLOCK_DV=HEAD_DIM),
        warmup=25, rep=100)
    result["preprocess_ms"] = pre
    for which in ("default", "best"):
        f = kern["fwd"][which]["ms"]
        result[f"{which}_fwd_ms"] = f
        result[f"{which}_fwd_bwd_kernels_ms"] = f + pre + kern["dq"][which]["ms"] + kern["dkdv"][which]["ms"]
    try:
        from polyrl.backends.cuda.fa4 import fa4_varlen_attention

        def fa4_fwd():
            return fa4_varlen_attention(q, k, v, cu, scale=scale, window=window, sinks=sinks)

        fa4_fwd()
        f_ms = do_bench(fa4_fwd, warmup=25, rep=100)

        def fa4_fb():
            fa4_fwd().backward(do)
        fa4_fb()
        fb_ms = do_bench(fa4_fb, warmup=25, rep=100, grad_to_none=[q, k, v, sinks])
        result["fa4_fwd_ms"], result["fa4_fwd_bwd_ms"] = f_ms, fb_ms
    except Exception as exc:
        result["fa4"] = f"not run: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"

    def ours_fb():
        triton_varlen_attention(q, k, v, cu, scale=scale, window=window, sinks=sinks, options=options).backward(do)
    ours_fb()
    result["polyrl_fwd_bwd_ms_end_to_end"] = do_bench(ours_fb, warmup=25, rep=100, grad_to_none=[q, k, v, sinks])
    line = (f"{layout} w={window}: kernels fwd+bwd default {result['default_fwd_bwd_kernels_ms']:.3f} ms, "
            f"best {result['best_fwd_bwd_kernels_ms']:.3f} ms; polyrl end to end {result['polyrl_fwd_bwd_ms_end_to_end']:.3f} ms")
    if "fa4_fwd_bwd_ms" in result:
        line += (f"; FA4 {result['fa4_fwd_ms']:.3f} / {result['fa4_fwd_bwd_ms']:.3f} ms -> ratio default "
                 f"{result['default_fwd_bwd_kernels_ms'] / result['fa4_fwd_bwd_ms']:.2f}x, best "
                 f"{result['best_fwd_bwd_kernels_ms'] / result['fa4_fwd_bwd_ms']:.2f}x")
    print(line, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="4x4096,1x16384")
    ap.add_argument("--windows", default="none")
    ap.add_argument("--kernels", default=",".join(CANDIDATES),
                    help="comma list of the kernels swept (the others run their default and Hopper pick only)")
    ap.add_argument("--variants-only", action="store_true",
                    help="swept kernels: their default, Hopper pick and variants, not their other plain candidates")
    ap.add_argument("--variants", default=None,
                    help="comma list of variant names (VARIANTS): only their rows, beside each swept kernel's "
                         "default and Hopper pick")
    ap.add_argument("--out", default="bench/results/attention_sweep.json")
    args = ap.parse_args(argv)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in kernels if k not in CANDIDATES]
    if unknown or not kernels:
        print(f"bench/attention_sweep.py: --kernels {args.kernels!r}: expected some of {', '.join(CANDIDATES)}",
              file=sys.stderr)
        return 2
    names = None
    if args.variants is not None:
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
        known = {v for k in kernels for v in VARIANTS.get(k, {})}
        if not names or set(names) - known:
            print(f"bench/attention_sweep.py: --variants {args.variants!r}: expected some of "
                  f"{', '.join(sorted(known))} (the swept kernels' variants)", file=sys.stderr)
            return 2
    import torch

    if not torch.cuda.is_available():
        print("bench/attention_sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    t0 = time.perf_counter()
    results = []
    for layout in args.layouts.split(","):
        for w in args.windows.split(","):
            results.append(sweep_layout(layout, None if w == "none" else int(w), kernels=kernels,
                                        variants_only=args.variants_only, variant_names=names))
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"), "shape": f"Hq {H_Q}, Hkv {H_KV}, D {HEAD_DIM}, bf16, sinks",
            "wall_s": round(time.perf_counter() - t0, 1)}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"wrote {args.out} ({meta['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
