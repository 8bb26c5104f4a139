"""How far bf16 alone moves the sync probe: the trainer's own log-probs in bf16 against the same weights in fp32,
on the probe sequences every sync is verified on (``polyrl.core.trainer.sync.probe_sequences``). No engine can be
verified below this floor in bf16: an exact bf16 engine differs from a bf16 trainer by rounding of this order.

    python bench/probe_floor.py                                   # 2 layers at GPT-OSS-20B width, 32 experts
    python bench/probe_floor.py --set num_local_experts=8 --vocab 4096 --out floor.json

Measured on the CPU (2026-12-02; 2 layers of GPT-OSS-20B, vocab 4096, random init, 202 probe tokens):
32 experts max 1.09 / p90 0.33 / median 0.090 nats; 8 experts max 0.84 / p90 0.16 / median 0.046 — the size of
the H200 vLLM engine's bf16 probe at that width (0.96 / 1.17, docs/rollout.md). gpt_oss_tiny: max 2.3e-3.
The probe's own estimate of this floor (``sync.precision_floor``: unit-roundoff noise on every layer's output),
which sets its bar below fp32 when the fixed one is exceeded: 32 experts 0.91-1.13, 8 experts 0.33-0.71, tiny 3e-3.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import yaml

from polyrl.core.models import build_model
from polyrl.core.plugins import get_registry
from polyrl.core.trainer import sync


def floor(preset: str, vocab: int, overrides: dict) -> dict:
    t0 = time.perf_counter()
    model = build_model(preset, vocab_size=vocab, overrides=overrides, seed=0)
    forward = dict(packed=True, pad_id=0, chunk_size=1024, logprobs=get_registry().backends["cpu"].logprobs)
    seqs = sync.probe_sequences(model.config, vocab, max_len=4096)
    fp32 = sync.trainer_logprobs(model, seqs, **forward)
    estimate_fp32 = sync.precision_floor(model, seqs, "bfloat16", **forward)  # fp32 trainer, bf16 engine
    bf16 = sync.trainer_logprobs(model.to(torch.bfloat16), seqs, **forward)
    estimate_bf16 = sync.precision_floor(model, seqs, "bfloat16", **forward)  # bf16 trainer, bf16 engine
    d = sorted(abs(a - b) for x, y in zip(fp32, bf16) for a, b in zip(x, y))
    return {"preset": preset, "vocab": vocab, "overrides": overrides, "tokens": len(d), "max": d[-1],
            "p90": d[int(0.9 * len(d))], "median": d[len(d) // 2], "estimate_fp32_trainer": estimate_fp32,
            "estimate_bf16_trainer": estimate_bf16, "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt_oss_20b")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="architecture override (default: num_hidden_layers=2)")
    ap.add_argument("--out")
    args = ap.parse_args()
    overrides = {"num_hidden_layers": 2}
    for item in args.overrides:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    res = floor(args.preset, args.vocab, overrides)
    print(f"{res['preset']} {res['overrides']} vocab {res['vocab']}: bf16 vs fp32 trainer log-probs over "
          f"{res['tokens']} probe tokens: max {res['max']:.3g}, p90 {res['p90']:.3g}, median {res['median']:.3g} "
          f"nats; the probe's own estimate (sync.precision_floor, max): {res['estimate_fp32_trainer']:.3g} for an fp32 "
          f"trainer, {res['estimate_bf16_trainer']:.3g} for a bf16 one ({res['wall_s']} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
