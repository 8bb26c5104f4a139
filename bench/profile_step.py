"""Where the time of a training step goes: start-up, first update, and a torch-profiler view of a few steps.

Builds the trainer of a recipe in-process (as ``polyrl run`` does), reports the seconds from process start to
imports done / trainer built / first step done, then the split of ``time/*`` metrics over ``--steps`` steps,
and a torch.profiler table (top ops by self device time, or self CPU time on the CPU) of ``--profile-steps``
steps, plus the number of kernel launches and host syncs per step.

    python bench/profile_step.py recipes/gpt_oss_dapo_tiny.yaml --backend cuda [--steps 20] [--profile-steps 3]
    torchrun --nproc-per-node 2 bench/profile_step.py ...   # sharded (FSDP2): adds the collectives' time per step

--profile-build: a cProfile of the trainer's build (the functions with the most cumulative time), for the
start-up that is not imports. --sync-sources N: for N steps, where the host waits for the device, by the line of
polyrl / transformers / torch code that asked (a CUDA build: ``torch.cuda.set_sync_debug_mode("warn")``, each
warning's call site counted; on the CPU nothing waits, so it reports that instead).

Under torchrun every rank steps and profiles; rank 0 prints and writes the summary, with the device time per
step of the all-gather / reduce-scatter / all-reduce kernels (NCCL, HCCL, ...) on rank 0.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402


def sync_sources(trainer, steps: int, device_type: str) -> dict[str, int]:
    """Host<-device synchronisations of ``steps`` steps, counted by the innermost polyrl / transformers / torch
    line that caused them (CUDA's sync debug mode warns at each one; the warnings are caught, not printed)."""
    import collections
    import traceback
    import warnings

    import torch

    if device_type != "cuda":
        print(f"--sync-sources: the {device_type} device has no host<-device syncs to count (CUDA only)")
        return {}
    counts: collections.Counter[str] = collections.Counter()

    def where() -> str:
        frames = [f for f in traceback.extract_stack()[:-3]
                  if any(k in f.filename for k in ("polyrl", "transformers", "torch/optim", "torch/nn"))]
        if not frames:
            return "?"
        f = frames[-1]
        return f"{f.filename.rsplit('site-packages/', 1)[-1].rsplit('/polyrl/', 1)[-1]}:{f.lineno} {f.name}"

    def on_warning(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message).lower():
            counts[where()] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores the filters and showwarning on the way out
            warnings.simplefilter("always")
            warnings.showwarning = on_warning
            for _ in range(steps):
                trainer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    total = sum(counts.values())
    print(f"host<-device syncs: {total / steps:.0f} per step, by call site (top 30 of {len(counts)}):")
    for site, n in counts.most_common(30):
        print(f"{n / steps:8.1f}  {site}")
    return {site: n / steps for site, n in counts.most_common()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write a JSON summary here")
    ap.add_argument("--profile-build", action="store_true", help="cProfile the trainer's build (start-up)")
    ap.add_argument("--sync-sources", type=int, default=0, metavar="N",
                    help="count the host<-device syncs of N steps by the code line that asked (CUDA)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import torch

    from polyrl.core import distributed as D
    from polyrl.core.config import load_config
    from polyrl.core.plugins.selection import set_active_backend
    from polyrl.core.trainer import Trainer

    t_import = time.perf_counter() - T0
    overrides = [*args.overrides, f"trainer.seed={args.seed}"]
    if args.backend:
        overrides.append(f"backend.name={args.backend}")
    cfg = load_config(args.recipe, overrides)
    backend = set_active_backend(cfg.backend.name)
    D.init_distributed(backend)
    main_rank = D.is_main_process()
    if not main_rank:
        import builtins
        import os

        builtins.print = lambda *a, **k: None  # one report, rank 0's
        os.environ["TQDM_DISABLE"] = "1"
    build_profile = None
    if args.profile_build:
        import cProfile

        build_profile = cProfile.Profile()
        build_profile.enable()
    trainer = Trainer(cfg, backend)
    t_built = time.perf_counter() - T0
    if build_profile is not None:
        import io
        import pstats

        build_profile.disable()
        text = io.StringIO()
        pstats.Stats(build_profile, stream=text).sort_stats("cumulative").print_stats(40)
        print("trainer build, cProfile by cumulative time:\n" + text.getvalue(), flush=True)
    rows = [trainer.step()]
    t_first = time.perf_counter() - T0
    print(f"start-up: imports {t_import:.2f} s, trainer built {t_built:.2f} s, first step done {t_first:.2f} s "
          f"(first step {rows[0]['time/step_s']:.2f} s)", flush=True)
    for _ in range(args.steps - 1):
        rows.append(trainer.step())
    keys = sorted(k for k in rows[0] if k.startswith("time/"))
    steady = rows[1:] or rows
    split = {k: statistics.median(r[k] for r in steady) for k in keys}
    print("median over steps 2..N: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in split.items()))
    print(f"reward/mean first {rows[0]['reward/mean']:.3f} last {rows[-1]['reward/mean']:.3f}")

    summary = {"recipe": args.recipe, "backend": backend.name, "import_s": t_import, "built_s": t_built,
               "first_step_done_s": t_first, "median_ms": {k: v * 1e3 for k, v in split.items()}}
    if args.profile_steps > 0:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        on_device = backend.device_type != "cpu"
        if on_device:
            acts.append(ProfilerActivity.CUDA)
        with profile(activities=acts) as prof:
            for _ in range(args.profile_steps):
                trainer.step()
        sort = "self_device_time_total" if on_device else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25))
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        syncs = sum(e.count for e in events if "Synchronize" in e.key or e.key == "aten::item"
                    or e.key == "aten::_local_scalar_dense")
        per = args.profile_steps
        print(f"per step: {launches / per:.0f} kernel launches, {syncs / per:.0f} host syncs (item/synchronize)")
        summary.update(launches_per_step=launches / per, syncs_per_step=syncs / per)
        if D.is_distributed() and on_device:
            comm = {}
            for e in events:
                name = e.key.lower()
                if "nccl" not in name and "hccl" not in name:
                    continue
                kind = next((k for k in ("allgather", "reducescatter", "allreduce", "broadcast", "sendrecv")
                             if k in name.replace("_", "")), "other")
                comm[kind] = comm.get(kind, 0.0) + e.self_device_time_total / 1e3 / per  # ms per step
            print("collectives, device ms per step (rank 0): " + ", ".join(f"{k} {v:.2f}" for k, v in comm.items()))
            summary.update(world_size=D.get_world_size(), collective_ms_per_step=comm)
    if args.sync_sources > 0:
        summary["sync_sources"] = sync_sources(trainer, args.sync_sources, backend.device_type)
    summary["peak_gib_rank0"] = max((r.get("memory/peak_gib", 0.0) for r in rows), default=None)
    if args.out and main_rank:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    del torch
    D.barrier()
    D.shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
