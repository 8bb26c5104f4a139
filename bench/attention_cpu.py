"""Reference varlen_attention vs dense eager on CPU: forward+backward time and peak memory, long single documents.

Every case runs in its own subprocess so that peak memory is honest: ``ru_maxrss`` (the process's peak
resident set) is read after the inputs are built and again after forward+backward, and the difference is
the peak the attention itself added. "eager" is what transformers' eager GPT-OSS attention does: a float
[T, T] causal mask added to [Hq, T, T] logits, the sink concatenated as a column, max-subtracted softmax,
the column dropped. Both run fp32 with sinks, GQA as given.

    .venv/bin/python bench/attention_cpu.py            # 2k, 4k, 8k tokens, 8 heads, d64; writes JSON
    .venv/bin/python bench/attention_cpu.py --quick    # 1k and 2k only
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "attention_cpu.json"
# docs/background.md §8 (H200, bf16, 64 q / 8 kv heads): eager with sink at 4096 tokens peaks at 16.4 GiB.
ANCHOR = "H200 anchor (docs/background.md §8, bf16, 64q/8kv heads, 4096 tokens): eager+sink fwd+bwd 58.0 ms, 16.4 GiB"


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def eager_attention(q, k, v, sinks, scale, window):
    """transformers' eager GPT-OSS attention on one document: q [Hq, T, D], k/v [Hkv, T, D]."""
    import torch

    hq, t, _ = q.shape
    g = hq // k.shape[0]
    k = k.repeat_interleave(g, dim=0)
    v = v.repeat_interleave(g, dim=0)
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    allowed = j <= i if window is None else (j <= i) & (i - j < window)
    mask = torch.zeros(t, t).masked_fill(~allowed, torch.finfo(torch.float32).min)
    logits = torch.matmul(q, k.transpose(1, 2)) * scale + mask
    logits = torch.cat([logits, sinks.view(hq, 1, 1).expand(hq, t, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs, v)


def run_case(impl: str, t: int, hq: int, hkv: int, d: int, window: int | None, repeats: int) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from polyrl.core.attention import varlen_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(t, hq, d, generator=gen, requires_grad=True)
    k = torch.randn(t, hkv, d, generator=gen, requires_grad=True)
    v = torch.randn(t, hkv, d, generator=gen, requires_grad=True)
    sinks = torch.randn(hq, generator=gen, requires_grad=True)
    d_out = torch.randn(t, hq, d, generator=gen)
    cu = torch.tensor([0, t], dtype=torch.int32)
    scale = d**-0.5

    def step():
        if impl == "reference":
            out = varlen_attention(q, k, v, cu, scale=scale, window=window, sinks=sinks, backend="cpu")
        else:
            out = eager_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), sinks, scale, window)
            out = out.transpose(0, 1)
        out.backward(d_out)
        for x in (q, k, v, sinks):
            x.grad = None

    # Warm up the BLAS / thread pool on a small document so the timed call measures the attention only.
    small = [x[:256].detach().requires_grad_(True) for x in (q, k, v)]
    out = varlen_attention(*small, cu.new_tensor([0, 256]), scale=scale, window=window, sinks=sinks, backend="cpu")
    out.sum().backward()
    sinks.grad = None
    base = _maxrss_mib()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = _maxrss_mib()
    return {
        "impl": impl,
        "tokens": t,
        "q_heads": hq,
        "kv_heads": hkv,
        "head_dim": d,
        "window": window,
        "sinks": True,
        "fwd_bwd_s": min(times),
        "peak_rss_mib": round(peak, 1),
        "baseline_rss_mib": round(base, 1),
        "attention_peak_mib": round(peak - base, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1k and 2k tokens only")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(**json.loads(args.case), repeats=args.repeats)))
        return

    hq, hkv, d = 8, 8, 64
    lengths = [1024, 2048] if args.quick else [2048, 4096, 8192]
    cases = []
    for t in lengths:
        for impl in ("reference", "eager"):
            cases.append(dict(impl=impl, t=t, hq=hq, hkv=hkv, d=d, window=None))
    cases.append(dict(impl="reference", t=lengths[-1], hq=hq, hkv=hkv, d=d, window=128))
    cases.append(dict(impl="reference", t=lengths[-1], hq=64, hkv=8, d=64, window=None))

    rows = []
    for case in cases:
        proc = subprocess.run(
            [sys.executable, __file__, "--case", json.dumps(case), "--repeats", str(args.repeats)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            rows.append({**case, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"{r.get('impl'):>9} T={case['t']:>5} Hq={case['hq']:>2} Hkv={case['hkv']} window={case['window']!s:>4} "
            + (
                f"fwd+bwd {r['fwd_bwd_s']:7.2f} s  peak +{r['attention_peak_mib']:8.1f} MiB (rss {r['peak_rss_mib']:.0f})"
                if "error" not in r
                else f"ERROR {r['error']}"
            ),
            flush=True,
        )

    summary = {}
    for t in lengths:
        ref = next(
            (
                r
                for r in rows
                if r.get("impl") == "reference"
                and r.get("tokens") == t
                and r.get("window") is None
                and r.get("q_heads") == hq
            ),
            None,
        )
        eag = next((r for r in rows if r.get("impl") == "eager" and r.get("tokens") == t), None)
        if ref and eag:
            summary[str(t)] = {
                "peak_ratio_reference_over_eager": round(ref["attention_peak_mib"] / eag["attention_peak_mib"], 4),
                "time_ratio_reference_over_eager": round(ref["fwd_bwd_s"] / eag["fwd_bwd_s"], 3),
            }
    print("\nreference / eager (attention's own peak, fwd+bwd time):")
    for t, s in summary.items():
        print(f"  T={t}: peak x{s['peak_ratio_reference_over_eager']}, time x{s['time_ratio_reference_over_eager']}")
    print(ANCHOR)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {"cases": rows, "summary": summary, "anchor": ANCHOR, "threads": int(os.environ.get("BENCH_THREADS", "2"))},
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
