"""Two GPUs against one: the tiny recipes (and any other recipe given) with ``--nproc 2`` beside ``--nproc 1``.

For each recipe: the same command (same seed, same global batch) on one GPU and, FSDP2-sharded over NCCL, on
two; per run the wall time, median step time, peak memory per GPU (the max over ranks) and the reward and loss
curves; between the two runs the mean absolute difference of the reward curves and of the policy-loss curves,
and the last-10-step reward of each. Then, on two GPUs: the collectives' device time per step (torch profiler on
rank 0, ``bench/profile_step.py`` under torchrun) and the failure drill: SIGKILL one rank mid-step, time until
every process has exited and what was printed, then the same command again, resuming from the last checkpoint,
compared with the uninterrupted two-GPU run.

    python bench/two_gpu.py [--recipes gpt_oss_dapo_tiny deepseek_ppo_tiny] [--backend cuda] [--out FILE]

Prints a table and writes bench/results/two_gpu.json (or --out). Runs on any machine with two devices of the
backend; on a CPU-only machine ``--backend cpu`` runs the same drill over gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from polyrl.core.distributed.launch import worker_pids  # noqa: E402


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    return env


def _cmd(recipe: str, out: Path, nproc: int, backend: str, seed: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "polyrl", "run", f"{recipe}.yaml", "--backend", backend, "--seed", str(seed),
            "--output", str(out), "--no-progress", "--nproc", str(nproc), *extra]  # fmt: skip


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _run(cmd: list[str], timeout: float) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return p.returncode, time.perf_counter() - t0, p.stderr[-4000:]


def _summary(rows: list[dict], rc: int, wall: float) -> dict:
    return {
        "rc": rc, "wall_s": round(wall, 1), "steps": len(rows),
        "median_step_ms": None if not rows else round(1e3 * _median([r["time/step_s"] for r in rows]), 1),
        "peak_gib": max((r.get("memory/peak_gib", 0.0) for r in rows), default=None),
        "reward_first10": _mean([r["reward/mean"] for r in rows[:10]]),
        "reward_last10": _mean([r["reward/mean"] for r in rows[-10:]]),
        "reward": [r["reward/mean"] for r in rows], "loss_policy": [r.get("loss/policy") for r in rows],
    }  # fmt: skip


def _mad(a: list, b: list) -> float | None:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return sum(abs(x - y) for x, y in pairs) / len(pairs) if pairs else None


def kill_drill(recipe: str, work: Path, backend: str, seed: int, reference: list[dict], save_every: int,
               extra: list[str]) -> dict:
    out = work / f"{recipe}-kill"
    cmd = _cmd(recipe, out, 2, backend, seed, [*extra, f"trainer.save_every={save_every}"])
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    kill_after = save_every + 2  # the kill lands two steps past a checkpoint
    deadline = time.monotonic() + 300
    while len(_metrics(out)) < kill_after:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            return {"error": "the run ended or stalled before the kill point", "stderr": proc.stderr.read()[-3000:]}
        time.sleep(0.05)
    pids = worker_pids(proc.pid)
    victim = pids.get(1)
    t0 = time.perf_counter()
    os.kill(victim, signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    exit_s = time.perf_counter() - t0
    lines = [x for x in err.splitlines() if x.startswith("polyrl run:")]
    rc, wall, tail = _run(cmd, 600)
    rows = _metrics(out)
    ckpt = save_every
    return {
        "killed_rank": 1, "killed_after_step": kill_after, "all_exited_s": round(exit_s, 2), "rc": proc.returncode,
        "lines": lines, "traceback_printed": "Traceback" in err, "resume_rc": rc, "resume_wall_s": round(wall, 1),
        "resume_steps": len(rows),
        "resumed_vs_uninterrupted_reward_mad": _mad([r["reward/mean"] for r in rows[ckpt:]],
                                                    [r["reward/mean"] for r in reference[ckpt:]]),
        "resumed_vs_uninterrupted_loss_mad": _mad([r.get("loss/policy") for r in rows[ckpt:]],
                                                  [r.get("loss/policy") for r in reference[ckpt:]]),
        "resume_stderr_tail": tail if rc else "",
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", nargs="+", default=["gpt_oss_dapo_tiny", "deepseek_ppo_tiny"])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-kill", action="store_true")
    ap.add_argument("--set", nargs="*", default=[], metavar="key.path=value", help="overrides for every run")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "two_gpu.json"))
    args = ap.parse_args()

    import torch

    work = Path(tempfile.mkdtemp(prefix="polyrl-two-gpu-"))
    res: dict = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "torch": torch.__version__,
                 "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                 "devices": torch.cuda.device_count() if torch.cuda.is_available() else 0, "recipes": {}}  # fmt: skip
    print(f"{res['device']} x{res['devices']}, torch {res['torch']}", flush=True)
    for recipe in args.recipes:
        entry: dict = {}
        for nproc in (1, 2):
            out = work / f"{recipe}-{nproc}"
            rc, wall, tail = _run(_cmd(recipe, out, nproc, args.backend, args.seed, args.set), 600)
            entry[f"gpus{nproc}"] = _summary(_metrics(out), rc, wall)
            if rc:
                entry[f"gpus{nproc}"]["stderr_tail"] = tail
            s = entry[f"gpus{nproc}"]
            print(f"{recipe} --nproc {nproc}: rc {rc}, wall {wall:.1f} s, {s['steps']} steps, median step "
                  f"{s['median_step_ms']} ms, peak {s['peak_gib']} GiB/GPU, reward {s['reward_first10']} -> "
                  f"{s['reward_last10']}", flush=True)  # fmt: skip
            if rc:
                print(tail, flush=True)
        one, two = entry["gpus1"], entry["gpus2"]
        entry["reward_mad"] = _mad(one["reward"], two["reward"])
        entry["loss_policy_mad"] = _mad(one["loss_policy"], two["loss_policy"])
        print(f"{recipe}: 2 GPUs vs 1: reward curve MAD {entry['reward_mad']}, policy-loss MAD "
              f"{entry['loss_policy_mad']}", flush=True)
        if not args.no_profile:
            prof = work / f"{recipe}-profile.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(REPO / "bench" / "profile_step.py"), f"recipes/{recipe}.yaml", *args.set, "--backend",
                   args.backend, "--steps", "6", "--profile-steps", "2", "--out", str(prof)]  # fmt: skip
            rc, wall, tail = _run(cmd, 600)
            entry["profile_2gpu"] = json.loads(prof.read_text()) if prof.exists() else {"rc": rc, "stderr": tail}
            print(f"{recipe} profile on 2 GPUs: {entry['profile_2gpu'].get('collective_ms_per_step')} "
                  f"(median split {entry['profile_2gpu'].get('median_ms')})", flush=True)
        res["recipes"][recipe] = entry
    if not args.no_kill:
        recipe = args.recipes[0]
        drill = kill_drill(recipe, work, args.backend, args.seed, _metrics(work / f"{recipe}-2"), save_every=5,
                            extra=args.set)
        res["kill_drill"] = drill
        print(f"kill drill ({recipe}, SIGKILL rank 1 mid-step): {json.dumps(drill, indent=1)}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
