"""Reduced-depth, real-width main job on one GPU: ``polyrl run recipes/gpt_oss_dapo.yaml --backend cuda`` with
2 layers (one sliding, one full) at GPT-OSS-20B width, random init, the synthetic copy task and the hf engine,
once with polyrl's attention and once with transformers' flex_attention, back to back in the same process
environment. Per run: rollout tokens/s, training tokens/s, the step split (rollout / old log-probs / update)
and peak memory, medians over steps 2..N; then the ratio polyrl / flex.

The task's vocabulary is the tiny tokenizer's (about 20 symbols: no hub, no GPT-OSS tokenizer here), so the
201k-vocabulary log-prob cost of the real model is not in these figures.

    python bench/real_width.py [--steps 20] [--layers 2] [--out bench/results/real_width.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def overrides(layers: int, steps: int) -> list[str]:
    types = ", ".join(["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2))
    return [
        f"model.overrides={{num_hidden_layers: {layers}, layer_types: [{types}]}}",
        # the recipe's checkpoint directory, chat prompts and 80 GB sizing are not what this measures
        "model.name=gpt_oss_20b", "data.prompt_format=raw", "rollout.micro_batch_size=0",
        "trainer.activation_checkpointing=false", "algorithm.micro_batch_tokens=32768",
        "data.task=copy", "data.task_params={k: 3, n_digits: 5}", "data.path=null", "data.max_prompt_length=64",
        "data.batch_size=16", "rollout.n=16", "rollout.max_response_length=128", "algorithm.overlong.buffer_length=32",
        # a random-init model never answers exactly: accuracy-based dynamic sampling would filter every group
        "algorithm.dynamic_sampling.enable=false", "algorithm.mini_batch_size=256",
        f"trainer.total_steps={steps}", "trainer.save_every=0",
    ]


def run(attn: str, args: argparse.Namespace, work: Path) -> dict:
    out = work / attn
    cmd = [sys.executable, "-m", "polyrl", "run", "recipes/gpt_oss_dapo.yaml", "--backend", args.backend,
           "--output", str(out), "--no-progress", f"model.attn_implementation={attn}", *overrides(args.layers, args.steps)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        return {"attn": attn, "rc": proc.returncode, "tail": (proc.stdout + proc.stderr)[-1500:]}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()][1:]
    med = lambda k: statistics.median(r[k] for r in rows if k in r)  # noqa: E731
    gen_tokens = [r["response/length_mean"] * r["dapo/groups_kept"] * 16 for r in rows]
    return {
        "attn": attn, "rc": 0, "wall_s": round(wall, 1), "steps": len(rows) + 1,
        "step_s": med("time/step_s"), "rollout_s": med("time/rollout_s"), "old_logprob_s": med("time/old_logprob_s"),
        "update_s": med("time/update_s"),
        "rollout_tok_s": statistics.median(g / r["time/rollout_s"] for g, r in zip(gen_tokens, rows)),
        "train_tok_s": statistics.median(r["batch/tokens"] / r["time/update_s"] for r in rows),
        "peak_gib": max(r.get("memory/peak_gib", 0.0) for r in rows),
        "reward_mean": statistics.mean(r["reward/mean"] for r in rows),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--impls", default="polyrl,flex_attention")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "real_width.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="polyrl-real-width-"))
    results = [run(a, args, work) for a in args.impls.split(",")]
    keys = ("step_s", "rollout_s", "old_logprob_s", "update_s", "rollout_tok_s", "train_tok_s", "peak_gib")
    print(f"{'attn':<16}" + "".join(f"{k:>15}" for k in keys))
    for r in results:
        if r["rc"]:
            print(f"{r['attn']:<16} failed rc={r['rc']}: {r['tail']}")
            continue
        print(f"{r['attn']:<16}" + "".join(f"{r[k]:>15.3f}" for k in keys))
    ok = [r for r in results if not r["rc"]]
    if len(ok) == 2:
        a, b = ok
        print(f"{'ratio ' + a['attn'] + '/' + b['attn']:<16}" + "".join(f"{a[k] / b[k]:>15.3f}" for k in keys))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"layers": args.layers, "overrides": overrides(args.layers, args.steps),
                                          "results": results}, indent=1))
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
