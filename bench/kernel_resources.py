"""What each launch config of the Triton attention kernels costs in registers, spills and shared memory on Hopper,
compiled ahead of time: no GPU needed (Triton's own ptxas builds sm_90a code on any machine).

For every candidate of bench/attention_sweep.py's CANDIDATES (the forward, dQ and dK/dV kernels, GPT-OSS shapes:
64 query / 8 kv heads, head dim 64, bf16, causal or a window), the kernel is compiled for the target and the cubin
read back with cuobjdump: registers per thread, the stack frame (bytes per thread that did not fit the 255
registers: spills), shared memory, and how the code moves data and multiplies (SASS counts of HGMMA = wgmma,
UTMALDG = TMA loads, LDGSTS = cp.async, LDL / STL = spill traffic). With ``--sweep`` (an attention_sweep.py JSON
from a GPU) each config's measured time is printed beside its resources, so a slow config can be read as spilling
or not.

    python bench/kernel_resources.py [--kernels fwd,dq,dkdv] [--windows none,128] [--configs N] [--capability 90]
                                     [--sweep bench/results/.../attention_sweep.json] [--out kernel_resources.json]

The numbers are those of the Triton installed here: compile with the GPU machine's Triton version (printed first)
to read the code that runs there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_sweep import CANDIDATES, H_KV, H_Q, HEAD_DIM, VARIANTS, config_label, sweep_rows

SASS_OPS = ("HGMMA", "UTMALDG", "LDGSTS", "LDL", "STL", "MUFU.EX2")


def _arg_type(name: str) -> str:
    """The signature type of a kernel argument, by the kernels' naming: fp32 row statistics, int32 document
    bounds, bf16 tensors, fp32 scales, int32 sizes and strides."""
    if name in ("lse_ptr", "delta_ptr", "d_exact_ptr", "sink_ptr", "dq_acc_ptr"):
        return "*fp32"
    if name in ("doc_start_ptr", "doc_end_ptr"):
        return "*i32"
    if name.endswith("_ptr"):
        return "*bf16"
    if name in ("qk_scale", "scale"):
        return "fp32"
    return "i32"


def _jit_function(kernel):
    import triton

    fn = kernel
    while not isinstance(fn, triton.runtime.JITFunction):  # autotuner / heuristics wrappers
        fn = fn.fn
    return fn


def compile_config(kernel, constexprs: dict, num_warps: int, num_stages: int, capability: int = 90):
    """Compile ``kernel`` (a Triton kernel, possibly autotuned) for ``sm_<capability>`` with the given constexprs;
    pointers and strides get the 16-divisibility the real launches have; a constexpr not given takes the kernel's
    own default (the variant flags), one without a default is refused. Returns Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _jit_function(kernel)
    names = list(fn.arg_names)
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: constexprs not given: {', '.join(missing)}")
    signature = {n: "constexpr" if n in constexprs else _arg_type(n) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in constexprs and (signature[n].startswith("*") or n.startswith("stride"))}
    src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resources(compiled) -> dict:
    """Registers, stack (spill) bytes and shared memory per the cubin, and SASS op counts."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
        path = f.name
    try:  # one pass: the resource line and the SASS listing
        dump = subprocess.run([_tool("cuobjdump"), "-res-usage", "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(path)
    field = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", dump))
    instr = [line for line in dump.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    row = {"registers": int(field.get("REG", 0)), "stack_bytes": int(field.get("STACK", 0)),
           "local_bytes": int(field.get("LOCAL", 0)), "shared_bytes": int(compiled.metadata.shared),
           "instructions": len(instr)}
    row.update({op: sum(op in line for line in instr) for op in SASS_OPS})
    return row


def kernel_constexprs(kernel: str, window: int | None, block_m: int, block_n: int, variant: str = "") -> dict:
    """The constexprs polyrl.backends.cuda.attention passes for a GPT-OSS layer (bf16: DOT_PREC "tf32" is unused
    by bf16 dots; the band path for windows up to 256, as the default KernelOptions); ``variant``: a name of
    attention_sweep.VARIANTS for this kernel."""
    g_p = H_Q // H_KV
    c = dict(D=HEAD_DIM, DV=HEAD_DIM, G_P=g_p, BLOCK_D=HEAD_DIM, BLOCK_DV=HEAD_DIM, HAS_WINDOW=window is not None,
             DOT_PREC="tf32", BAND=window is not None and window <= 256, BLOCK_M=block_m, BLOCK_N=block_n)
    if kernel in ("fwd", "dq"):  # the variant flags (TMA, PREFETCH, HEADS_INNER) default off in the kernels
        c.update(HEAVY_FIRST=False)
    if kernel == "fwd":
        c.update(HAS_SINK=True)
    c.update(VARIANTS[kernel].get(variant, {}) if variant else {})
    return c


def kernels() -> dict:
    from polyrl.backends.cuda.kernels.backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
    from polyrl.backends.cuda.kernels.forward import attn_fwd_kernel

    return {"fwd": attn_fwd_kernel, "dq": attn_bwd_dq_kernel, "dkdv": attn_bwd_dkdv_kernel}


def measured(sweep: dict | None, kernel: str, window: int | None, cfg: tuple, variant: str = "") -> list[float]:
    """ms of this (kernel, window, config, variant) in an attention_sweep.py JSON, one per layout (the forward's
    and dQ's heavy-first rows are the same code: left out)."""
    if not sweep:
        return []
    label = config_label(cfg, variant)
    return [row["ms"] for case in sweep.get("results", []) if case.get("window") == window
            for row in case.get("kernels", {}).get(kernel, {}).get("rows", []) if row.get("config") == label]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default="fwd,dq,dkdv")
    ap.add_argument("--windows", default="none", help="comma list: none (causal) and/or window sizes")
    ap.add_argument("--capability", type=int, default=90, help="compute capability x10 (90: H100 / H200)")
    ap.add_argument("--configs", type=int, default=0, metavar="N",
                    help="only the first N candidates of each kernel (0: all; the first is the default)")
    ap.add_argument("--sweep", default=None, help="an attention_sweep.py JSON: measured ms beside each config")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("kernel_resources: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    import triton

    sweep = None
    if args.sweep:
        try:
            with open(args.sweep) as f:
                sweep = json.load(f)
        except (OSError, ValueError) as e:
            print(f"kernel_resources: --sweep {args.sweep}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    wanted = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in wanted if k not in CANDIDATES]
    if unknown:
        print(f"kernel_resources: unknown kernel(s) {', '.join(unknown)}; known: {', '.join(CANDIDATES)}",
              file=sys.stderr)
        return 2
    try:
        windows = [None if w.strip() == "none" else int(w) for w in args.windows.split(",")]
    except ValueError:
        print(f"kernel_resources: --windows {args.windows!r}: expected 'none' and/or window sizes, comma-separated",
              file=sys.stderr)
        return 2
    if any(w is not None and w < 1 for w in windows):
        print(f"kernel_resources: --windows {args.windows!r}: a window is at least 1 key", file=sys.stderr)
        return 2
    print(f"triton {triton.__version__}, target sm_{args.capability}, GPT-OSS heads {H_Q}/{H_KV}, d {HEAD_DIM}, bf16")
    header = (f"{'kernel':5s} {'window':>6s} {'config (M, N, warps, stages)':>29s} {'regs':>5s} {'stack B':>8s} "
              f"{'shared KiB':>10s} {'HGMMA':>6s} {'TMA':>4s} {'cp.async':>8s} {'LDL/STL':>8s}  measured ms")
    print(header)
    rows = []
    table = kernels()
    for window in windows:
        for name in wanted:
            # all candidates (or the first N), then (all only) the variants on their listed tiles (TMA, dK/dV's
            # PREFETCH; the launch orders HEAVY_FIRST / HEADS_INNER change only the program -> tile mapping)
            variants = [(cfg, "") for cfg in CANDIDATES[name][: args.configs or None]]
            if not args.configs:
                variants += sweep_rows(name, [])
            for cfg, variant in variants:
                m, n, w, s = cfg
                t0 = time.perf_counter()
                compiled = compile_config(table[name], kernel_constexprs(name, window, m, n, variant), w, s,
                                          args.capability)
                r = resources(compiled)
                ms = measured(sweep, name, window, cfg, variant)
                rows.append(dict(kernel=name, window=window, config=list(cfg), variant=variant, measured_ms=ms,
                                 compile_s=time.perf_counter() - t0, **r))
                label = f"{cfg!s} {variant}".rstrip()
                print(f"{name:5s} {window!s:>6s} {label:>29s} {r['registers']:5d} {r['stack_bytes']:8d} "
                      f"{r['shared_bytes'] / 1024:10.1f} {r['HGMMA']:6d} {r['UTMALDG']:4d} {r['LDGSTS']:8d} "
                      f"{r['LDL'] + r['STL']:8d}  {' / '.join(f'{x:.3f}' for x in ms)}", flush=True)
    for case in (sweep or {}).get("results", []):  # the peer, from the same GPU run as the measured ms
        ours, fa4 = case.get("default_fwd_bwd_kernels_ms"), case.get("fa4_fwd_bwd_ms")
        if ours and fa4:
            print(f"sweep {case['layout']} window {case['window']}: polyrl kernels fwd+bwd {ours:.3f} ms, FA4 "
                  f"{fa4:.3f} ms, ratio {ours / fa4:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"triton": triton.__version__, "capability": args.capability,
                       "shapes": {"h_q": H_Q, "h_kv": H_KV, "head_dim": HEAD_DIM, "dtype": "bf16"},
                       "sweep": args.sweep, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
