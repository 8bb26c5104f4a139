"""Worker of the expert-parallel step tests, started by torchrun: in one process group, for each recipe, a trainer
with ``sharding.expert_parallel=1`` (today's FSDP2 path) collects and prepares one update; trainers with the
other ep sizes (same seed, so same initial weights) collect on their own (the hf engine running the EP model)
and update on the same inputs. Rank 0 writes, per recipe and ep: the update's metrics, the per-tensor update
differences against ep=1 (``polyrl.parity.train.update_differences``) and how many responses of their own
rollout equal ep=1's.

    torchrun --nproc-per-node N ep_worker.py OUT.json EPS RECIPE [RECIPE ...] [-- OVERRIDE ...]
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import torch

    from polyrl.core import distributed as D
    from polyrl.core.config import load_config
    from polyrl.core.distributed.expert_parallel import ExpertParallelExperts
    from polyrl.core.distributed.process import end_process
    from polyrl.core.plugins import list_backends
    from polyrl.core.trainer import Trainer, flatten
    from polyrl.parity.train import update_differences

    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    out_path, eps, recipes = argv[0], [int(e) for e in argv[1].split(",")], argv[2:]
    torch.use_deterministic_algorithms(True, warn_only=True)  # as `polyrl run` on the reference backend
    backend = list_backends()["cpu"]
    ctx = D.init_distributed(backend, timeout_s=300)
    torch.set_num_threads(1)

    def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().clone()
                for n, p in model.named_parameters()}

    def models(t: Trainer) -> dict[str, torch.nn.Module]:
        return {k: m for k, m in (("actor", t.models.actor), ("critic", t.models.critic)) if m is not None}

    result: dict = {}
    for recipe in recipes:
        def cfg(ep: int, _recipe: str = recipe):
            return load_config(f"recipes/{_recipe}.yaml", ["trainer.seed=0", "trainer.num_threads=0",
                                                           f"sharding.expert_parallel={ep}", *extra])

        ref = Trainer(cfg(1), backend)
        exp = ref.collect()
        before_ref = {k: snapshot(m) for k, m in models(ref).items()}
        inputs = ref.prepare_update(exp)
        m_ref = flatten(ref.update(inputs))
        after_ref = {k: snapshot(m) for k, m in models(ref).items()}
        rows = {"1": {"metrics": m_ref}}
        for ep in eps:
            t = Trainer(cfg(ep), backend)
            ms = models(t)
            before = {k: snapshot(m) for k, m in ms.items()}
            same_init = all(torch.equal(before[k][n], before_ref[k][n]) for k in before for n in before[k])
            own = t.collect()
            same = sum(a == b for a, b in zip(own.batch.responses, exp.batch.responses))
            m = flatten(t.update(inputs))
            after = {k: snapshot(mod) for k, mod in ms.items()}
            experts = [mod for mod in t.models.actor.modules() if isinstance(mod, ExpertParallelExperts)]
            rows[str(ep)] = {
                "metrics": m, "same_init": same_init, "experts_modules": len(experts),
                "same_responses": [same, len(exp.batch.responses)],
                "updates": {k: update_differences(before_ref[k], after_ref[k], before[k], after[k]) for k in ms},
            }
        result[recipe] = rows
    if ctx.rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    end_process(0)  # as `polyrl run` ends: a barrier, the group destroyed, no interpreter teardown


if __name__ == "__main__":
    main()
