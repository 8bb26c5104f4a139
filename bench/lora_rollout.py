"""Generation speed of the hf engine with LoRA adapters: merged for the generate call, through the adapters
(unmerged), and the same model without adapters (the anchor), in generated tokens per second.

    python bench/lora_rollout.py                    # the tiny GPT-OSS and a wider one (CPU), 32 rows x 32 tokens
    python bench/lora_rollout.py --backend cuda     # on a GPU

Every configuration generates the same prompts with the same row seeds (the merged and unmerged runs sample the
same tokens: tests/models/test_lora.py). Prints a table and writes bench/results/lora_rollout.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch

from polyrl.core.config import LoraConfig
from polyrl.core.models import build_model
from polyrl.core.models import lora as L
from polyrl.core.plugins.selection import resolve_backend
from polyrl.core.rollout.engine import SamplingParams
from polyrl.core.rollout.hf import HFEngine

MODELS = {
    "gpt_oss_tiny": {"num_local_experts": 4},
    # wider: the experts' deltas cost more than the model's fixed overheads
    "gpt_oss_tiny_w256": {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": 8},
}


def _tokens_per_s(engines: dict[str, HFEngine], prompts: list[list[int]], params: SamplingParams,
                  repeats: int) -> dict[str, float]:
    """Best tokens/s of each engine over ``repeats`` rounds, the engines taking turns in every round (a busy
    machine slows them alike), after one warm-up round."""
    best = dict.fromkeys(engines, 0.0)
    for round_ in range(repeats + 1):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            out = engine.generate(prompts, params, row_seeds=list(range(len(prompts))))
            dt = time.perf_counter() - t0
            if round_:
                best[name] = max(best[name], sum(len(r) for r in out.response_ids) / dt)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    backend = resolve_backend(args.backend)
    device = backend.device(0)
    if args.backend == "cpu":
        torch.set_num_threads(2)
    vocab = 64
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, vocab, (8,), generator=gen).tolist() for _ in range(args.rows)]
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens)  # no stop token: every row runs to the end
    results = []
    for name, overrides in MODELS.items():
        base = build_model("gpt_oss_tiny", vocab_size=vocab, seed=0, overrides=overrides, backend=backend).to(device)
        adapted = copy.deepcopy(base)
        L.apply_lora(adapted, LoraConfig(enabled=True, rank=args.rank, alpha=2.0 * args.rank))
        with torch.no_grad():
            for n, p in adapted.named_parameters():
                if ".lora_B." in n:
                    p.normal_(0.0, 0.02)
        row = {"model": name, "trainable": L.trainable_parameters(adapted),
               "parameters": sum(p.numel() for p in base.parameters())}
        unmerged = HFEngine(adapted, pad_token_id=0)
        unmerged.merge_adapters = False
        engines = {"no_lora": HFEngine(base, pad_token_id=0), "merged": HFEngine(adapted, pad_token_id=0),
                   "unmerged": unmerged}
        row.update(_tokens_per_s(engines, prompts, params, args.repeats))
        results.append(row)
        print(f"{name:20s} trainable {row['trainable']:>9,} of {row['parameters']:>10,}   tokens/s: no LoRA "
              f"{row['no_lora']:8.0f}   merged {row['merged']:8.0f}   unmerged {row['unmerged']:8.0f}")
    out = Path(__file__).with_name("results") / "lora_rollout.json"
    out.write_text(json.dumps({"host": platform.node(), "backend": args.backend, "rows": args.rows,
                               "tokens": args.tokens, "rank": args.rank, "torch": torch.__version__,
                               "results": results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
