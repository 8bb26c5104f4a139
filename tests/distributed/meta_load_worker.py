"""Worker of the sharded-load tests, started by torchrun (gloo): for each recipe, the models ``build_models`` gives
with sharding on (rank 0 builds, the other ranks meta skeletons loaded from it) against the same function's build
with sharding off (every rank builds the whole model as one process does). Each rank writes OUT.rankR.json: per
recipe and model, how many of the parameters it sharded were real (not on the meta device), and the parameters and buffers
(gathered to full tensors) that differ from its own unsharded build. With ``--steps N`` it also trains N steps
with the sharded load and N steps with every rank building the full model (the build before rank-0 loading), and
writes both runs' metrics.

    torchrun --nproc-per-node 2 meta_load_worker.py OUT RECIPE[:OVERRIDE,...] [...] [--steps N]
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import torch

    from polyrl.core import distributed as D
    from polyrl.core.config import load_config
    from polyrl.core.distributed import loading
    from polyrl.core.distributed.process import end_process
    from polyrl.core.plugins import list_backends
    from polyrl.core.trainer import Trainer, seed_everything
    from polyrl.core.trainer import setup as S

    argv = sys.argv[1:]
    steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 0
    argv = argv[:argv.index("--steps")] if "--steps" in argv else argv
    out, specs = argv[0], argv[1:]
    torch.use_deterministic_algorithms(True, warn_only=True)  # as `polyrl run` on the reference backend
    backend = list_backends()["cpu"]
    D.init_distributed(backend, timeout_s=300)
    torch.set_num_threads(1)
    device = torch.device("cpu")

    seen: list[list[int]] = []  # per shard_from_rank0 call: [parameter elements not on meta, all] before sharding
    real_shard = loading.shard_from_rank0

    def watched(model, *args, **kwargs):
        params = list(model.parameters())
        seen.append([sum(p.numel() for p in params if not p.is_meta), sum(p.numel() for p in params)])
        return real_shard(model, *args, **kwargs)

    loading.shard_from_rank0 = watched

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def tensors(m: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {f"{kind}:{n}": full(t).detach().clone()
                for kind, named in (("param", m.named_parameters()), ("buffer", m.named_buffers())) for n, t in named}

    result: dict = {}
    for spec in specs:
        recipe, _, extra = spec.partition(":")
        overrides = ["trainer.seed=0", "trainer.num_threads=0", *(extra.split(",") if extra else [])]
        cfg = load_config(f"recipes/{recipe}.yaml", overrides)
        task = S.build_task(cfg)
        vocab = len(S.build_tokenizer(cfg, task)) if task.vocab() else None
        seed_everything(0)
        plain = S.build_models(load_config(f"recipes/{recipe}.yaml", [*overrides, "sharding.enabled=false"]),
                               vocab, backend, device)
        seed_everything(0)
        seen.clear()
        sharded = S.build_models(cfg, vocab, backend, device)
        row: dict = {"meta_before": list(seen)}
        for name in ("actor", "ref", "critic"):
            a, b = getattr(plain, name), getattr(sharded, name)
            if a is None:
                continue
            want, got = tensors(a), tensors(b)
            row[name] = {
                "tensors": len(want),
                "buffers": sum(k.startswith("buffer:") for k in want),
                "differ": sorted(k for k in want if k not in got or got[k].dtype != want[k].dtype
                                 or not torch.equal(got[k], want[k])) + sorted(set(got) - set(want)),
            }
        if steps:
            runs = {}
            for mode in ("rank0", "every_rank"):
                loading_on = loading.builds_on_rank0
                if mode == "every_rank":
                    loading.builds_on_rank0 = lambda settings: False
                try:
                    t = Trainer(cfg, backend)
                finally:
                    loading.builds_on_rank0 = loading_on
                runs[mode] = [{k: v for k, v in t.step().items() if not k.startswith("time/")} for _ in range(steps)]
            row["steps"] = runs
        result[spec] = row
    with open(f"{out}.rank{D.get_rank()}.json", "w") as f:
        json.dump(result, f)
    end_process(0)  # as `polyrl run` ends: a barrier, the group destroyed, no interpreter teardown


if __name__ == "__main__":
    main()
