"""Peak host memory of each rank while ``build_models`` builds a sharded actor under torchrun (CPU, gloo): with
the sharded load (rank 0 builds, the other ranks meta skeletons) or, with ``--every-rank``, every rank building
the whole model first (the build before the sharded load). The model is ``gpt_oss_tiny`` widened by
``model.overrides`` to 85 M fp32 parameters (325 MiB).

    torchrun --standalone --nproc-per-node 2 bench/sharded_load_memory.py [--every-rank] [--out FILE.json]

Prints one JSON line per rank: RSS (MiB) before the build (the model code already imported), the peak during it
(``ru_maxrss``), after it, and the actor's full size.
"""

from __future__ import annotations

import argparse
import json
import resource

OVERRIDES = {"hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 12, "num_local_experts": 8,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--every-rank", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()

    import torch

    from polyrl.core import distributed as D
    from polyrl.core.config import load_config
    from polyrl.core.distributed import loading
    from polyrl.core.plugins import list_backends
    from polyrl.core.trainer import setup as S

    backend = list_backends()["cpu"]
    D.init_distributed(backend, timeout_s=300)
    torch.set_num_threads(1)
    cfg = load_config("recipes/gpt_oss_dapo_tiny.yaml", [f"model.overrides={json.dumps(OVERRIDES)}"])
    task = S.build_task(cfg)
    vocab = len(S.build_tokenizer(cfg, task)) if task.vocab() else None
    if args.every_rank:
        loading.builds_on_rank0 = lambda settings: False
    # The model code's imports (transformers' modeling modules, ~170 MiB) land outside the measure: a meta build
    S._build_lm(cfg.model.name, cfg, vocab, dict(cfg.model.overrides), 0, backend, meta=True)
    D.barrier()
    before = rss_mib()
    models = S.build_models(cfg, vocab, backend, torch.device("cpu"))
    D.barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    weights = sum(p.numel() * p.element_size() for p in models.actor.parameters())  # DTensor: the global numel
    row = {"rank": D.get_rank(), "mode": "every_rank" if args.every_rank else "rank0",
           "rss_before_mib": round(before), "peak_mib": round(peak), "rss_after_mib": round(rss_mib()),
           "weights_mib": round(weights / 2**20)}
    rows = D.all_gather_object(row)
    if D.get_rank() == 0:
        for r in rows:
            print(json.dumps(r))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    D.shutdown_distributed()


if __name__ == "__main__":
    main()
