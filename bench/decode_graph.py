"""The hf engine's decode modes side by side: ``dynamic`` (transformers' growing cache), ``static`` (preallocated
cache, fixed shapes) and ``graph`` (static, each step one CUDA-graph replay), same model, prompts and
uniforms, in one process.

Cases: the tiny recipes' generate call (gpt_oss_tiny and deepseek_v3_tiny, 64 prompts x 8 samples of 7 tokens, up to
6 new tokens: what `gpt_oss_dapo_tiny` runs 1-3 times a step) and a longer one (64 rows x 128 new tokens, no stop).
Per case and mode: ms per generate call (median of --iters after 2 warm-up calls, which include the capture), the
ratio to dynamic, whether the tokens equal dynamic's, and the largest log-prob difference.

    python bench/decode_graph.py [--backend cuda] [--iters 10] [--out bench/results/decode_graph.json]

On a backend without device graphs (``Backend.device_graph()`` None: cpu) only dynamic and static run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

CASES = {  # name -> (preset, distinct prompts, samples each, prompt length, new tokens, stop token or None)
    "gpt_oss_tiny recipe call": ("gpt_oss_tiny", 64, 8, 7, 6, 3),
    "deepseek_v3_tiny recipe call": ("deepseek_v3_tiny", 64, 8, 7, 6, 3),
    "gpt_oss_tiny 128 tokens": ("gpt_oss_tiny", 64, 1, 16, 128, None),
}


def run_case(name: str, backend_name: str, iters: int) -> dict:
    import torch

    from polyrl.core.models import build_model
    from polyrl.core.plugins.selection import backend_for
    from polyrl.core.rollout import SamplingParams, build_engine

    preset, distinct, n, plen, tokens, stop = CASES[name]
    backend = backend_for(backend_name)
    device = torch.device(backend.device_type)
    model = build_model(preset, vocab_size=17, seed=0, backend=backend, device=device).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 17, (plen,), generator=g).tolist() for _ in range(distinct) for _ in range(n)]
    params = SamplingParams(temperature=1.0, max_tokens=tokens, stop_token_ids=[stop] if stop is not None else [])
    modes = ["dynamic", "static"] + (["graph"] if backend.device_graph() is not None else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows, first = [], None
    for mode in modes:
        engine = build_engine("hf", model, pad_token_id=0, decode=mode, backend=backend)
        times = []
        for i in range(iters + 2):
            sync()
            t = time.perf_counter()
            out = engine.generate(prompts, params, row_seeds=list(range(len(prompts))))
            sync()
            if i >= 2:
                times.append(time.perf_counter() - t)
        if first is None:
            first = out
        err = max((abs(a - b) for x, y in zip(out.logprobs, first.logprobs) for a, b in zip(x, y)), default=0.0)
        rows.append({"mode": mode, "ms": 1e3 * statistics.median(times), "same_tokens": out.response_ids == first.response_ids,
                     "max_logprob_diff": err, "mean_len": sum(map(len, out.response_ids)) / len(prompts),
                     "captures": getattr(engine._static, "captures", None)})
    base = rows[0]["ms"]
    for r in rows:
        r["x_dynamic"] = r["ms"] / base
        print(f"{name:30s} {r['mode']:10s} {r['ms']:9.2f} ms  x{r['x_dynamic']:.3f} of dynamic  tokens "
              f"{'same' if r['same_tokens'] else 'DIFFER'}  max |dlogp| {r['max_logprob_diff']:.1e}  "
              f"mean length {r['mean_len']:.1f}  captures {r['captures']}", flush=True)
    return {"case": name, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    from polyrl.core.plugins.selection import set_active_backend

    set_active_backend(args.backend)
    results = [run_case(c, args.backend, args.iters) for c in args.cases]
    if args.out:
        meta = {"backend": args.backend, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                "device": torch.cuda.get_device_name() if args.backend == "cuda" else "cpu"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
