"""Peak host memory of per-token logprobs + entropy: chunked fp32 (polyrl) vs the direct computation.

Method: each case runs in a fresh subprocess. The child fills bf16 logits [T, V] row block by row block
(so building them never spikes memory), reads its resident set size (RSS, /proc/self/statm), runs the
case, and reads the kernel's high-water mark ``ru_maxrss`` (resource.getrusage). ``peak extra`` =
high-water mark − RSS before the case: everything the computation held at its worst moment, whatever
allocated it (torch's CPU allocator does not cache, and blocks this large are mmap'd and returned to the
OS on free, so RSS follows the live tensors). tracemalloc would not see torch's allocations at all.

The chunked path's bound: one fp32 [chunk, V] work block (+ small per-row vectors); in backward also the
gradient of the logits (same dtype and size as the logits), which every method must return.

Usage: python bench/logprob_memory.py [--T 2048] [--V 201088] [--chunks 256 1024]
Writes bench/results/logprob_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

MiB = 1024 * 1024


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(method: str, backward: bool, T: int, V: int, chunk: int) -> dict:
    import torch

    from polyrl.core import algorithms as A

    torch.manual_seed(0)
    torch.set_num_threads(1)  # timings stay stable when other jobs share the cores
    logits = torch.empty(T, V, dtype=torch.bfloat16)
    for t0 in range(0, T, 64):
        logits[t0 : t0 + 64] = torch.randn(min(64, T - t0), V) * 3
    labels = torch.randint(0, V, (T,))
    if backward:
        logits.requires_grad_()
    # warm up kernels and allocator on a tiny problem so one-time costs are not counted
    small = torch.randn(4, 8, requires_grad=True)
    A.logprobs_and_entropy(small, torch.zeros(4, dtype=torch.long), chunk_size=2)[0].sum().backward()

    rss_before = _rss_bytes()
    start = time.perf_counter()
    if method == "direct":
        logs = torch.log_softmax(logits.float(), dim=-1)  # fp32 [T, V]
        logp = logs.gather(-1, labels[:, None]).squeeze(-1)
        ent = -(logs.exp() * logs).sum(-1)
    else:
        logp, ent = A.logprobs_and_entropy(logits, labels, chunk_size=chunk)
    if backward:
        (logp.sum() + 0.1 * ent.sum()).backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_extra_bytes": peak - rss_before, "seconds": seconds, "checksum": float(logp.double().sum())}


def _run_case(method: str, backward: bool, T: int, V: int, chunk: int) -> dict:
    cmd = [sys.executable, __file__, "--child", method, str(int(backward)), str(T), str(V), str(chunk)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--V", type=int, default=201088, help="GPT-OSS vocabulary")
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "logprob_memory.json"))
    args = parser.parse_args()
    T, V = args.T, args.V
    logits_bytes = T * V * 2
    rows = []
    cases = [("direct", None)] + [("chunked", c) for c in args.chunks]
    for backward in (False, True):
        for method, chunk in cases:
            res = _run_case(method, backward, T, V, chunk or 0)
            block = (chunk or 0) * V * 4
            bound = block + (logits_bytes if backward else 0) if method == "chunked" else None
            rows.append({"method": method, "chunk": chunk, "pass": "fwd+bwd" if backward else "fwd", **res,
                         "bound_bytes": bound})
    print(f"logprobs + entropy, bf16 logits [T={T}, V={V}] = {logits_bytes / MiB:.0f} MiB; "
          f"fp32 [T, V] = {T * V * 4 / MiB:.0f} MiB")
    print(f"{'method':<9} {'chunk':>6} {'pass':<8} {'peak extra MiB':>15} {'bound MiB':>10} {'time s':>7}")
    for r in rows:
        bound = f"{r['bound_bytes'] / MiB:.0f}" if r["bound_bytes"] is not None else "-"
        print(f"{r['method']:<9} {r['chunk'] or '-':>6} {r['pass']:<8} {r['peak_extra_bytes'] / MiB:>15.0f} "
              f"{bound:>10} {r['seconds']:>7.2f}")
    sums = {r["checksum"] for r in rows}
    print(f"logp checksums agree across methods: max spread {max(sums) - min(sums):.3g}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"T": T, "V": V, "logits_dtype": "bfloat16", "logits_bytes": logits_bytes, "host": platform.node(),
            "cpus": os.cpu_count(), "method": "subprocess per case; ru_maxrss high-water minus RSS before"}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        m, bwd, t, v, c = sys.argv[2:7]
        print(json.dumps(_child(m, bool(int(bwd)), int(t), int(v), int(c))))
    else:
        main()
