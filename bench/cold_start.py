"""A first run on a machine whose Triton cache is cold, with the backend's precompile on and off, in one process
tree: ``polyrl run <recipe> --backend cuda`` for a few steps, each run with a fresh, empty ``TRITON_CACHE_DIR``.

For each run: the wall of the command, the first step's time (``time/step_s`` of step 1, which is where the
kernels compile without precompile), the median of the later steps, how many kernels Triton compiled in all
(cubins in the run's cache) and the trainer's ``precompile:`` log line. Runs alternate off / on so that a machine
that warms (the OS page cache, byte code) favours neither; the first run also pays those and is reported apart.

    python bench/cold_start.py                                  # tiny DAPO, 8 steps, off / on twice
    python bench/cold_start.py --recipe polyrl/recipes/deepseek_ppo_tiny.yaml --pairs 1 --steps 5
    python bench/cold_start.py --pairs 1 --steps 3 --threads 1 2 4   # and precompile on 1, 2, 4 threads

With ``--threads``, one more run per count, precompile on with ``POLYRL_PRECOMPILE_THREADS`` set: the log line's
slowest compile and sum of compiles against the thread count tell one slow kernel from contention.

Prints a table, the ratio of the means (on / off) of first step and wall, and writes bench/results/cold_start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_once(recipe: str, steps: int, precompile: bool, seed: int, backend: str, threads: int | None = None) -> dict:
    """One ``polyrl run`` with an empty Triton cache; its wall, step times, compiled kernels and log line."""
    with tempfile.TemporaryDirectory(prefix="polyrl_cold_") as tmp:
        cache, out = Path(tmp) / "triton", Path(tmp) / "run"
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "POLYRL_PRECOMPILE": "1" if precompile else "0"}
        env.pop("POLYRL_PRECOMPILE_THREADS", None)
        if threads:
            env["POLYRL_PRECOMPILE_THREADS"] = str(threads)
        cmd = [sys.executable, "-m", "polyrl", "run", recipe, "--backend", backend, "--output", str(out),
               "--seed", str(seed), "--no-progress", f"trainer.total_steps={steps}", f"trainer.save_every={steps}"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        metrics = out / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        step_s = [r["time/step_s"] for r in rows if "time/step_s" in r]
        log = proc.stdout + proc.stderr
        return {
            "precompile": precompile, "threads": threads, "rc": proc.returncode, "wall_s": round(wall, 2),
            "first_step_s": round(step_s[0], 3) if step_s else None,
            "later_step_median_s": round(statistics.median(step_s[1:]), 4) if len(step_s) > 1 else None,
            "cubins": sum(1 for _ in cache.rglob("*.cubin")),
            "precompile_line": next((line.strip() for line in log.splitlines() if "precompile:" in line), ""),
            "tail": "" if proc.returncode == 0 else log[-1500:],
        }


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r[key] is not None]
    return statistics.fmean(vals) if vals else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="polyrl/recipes/gpt_oss_dapo_tiny.yaml")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=2, help="off / on pairs after the first (warming) run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, nargs="*", default=[],
                    help="after the pairs, one precompile-on run per thread count (POLYRL_PRECOMPILE_THREADS)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cold_start.json"))
    args = ap.parse_args(argv)

    order = [(False, None)] + [(p, None) for _ in range(args.pairs) for p in (False, True)]
    order += [(True, n) for n in args.threads]
    rows = []
    print(f"{'run':>4} {'precompile':>10} {'rc':>3} {'wall s':>7} {'step 1 s':>9} {'later s':>8} {'cubins':>6}  log line",
          flush=True)
    for i, (on, threads) in enumerate(order):
        r = run_once(args.recipe, args.steps, on, args.seed, args.backend, threads)
        r["run"] = i
        rows.append(r)
        print(f"{i:>4} {('on' if on else 'off') + (f' x{threads}' if threads else ''):>10} {r['rc']:>3} {r['wall_s']:>7} {r['first_step_s']!s:>9} "
              f"{r['later_step_median_s']!s:>8} {r['cubins']:>6}  {r['precompile_line'] or '-'}", flush=True)
        if r["tail"]:
            print(r["tail"], flush=True)
    measured = [r for r in rows[1:] if not r["threads"]]  # the first run also warms the machine
    off = [r for r in measured if not r["precompile"]]
    on = [r for r in measured if r["precompile"]]
    summary = {}
    for key in ("first_step_s", "wall_s"):
        a, b = _mean(off, key), _mean(on, key)
        summary[key] = {"off": a, "on": b, "ratio_on_off": (b / a) if a and b else None}
        print(f"{key}: off {a if a is None else round(a, 2)}  on {b if b is None else round(b, 2)}  "
              f"ratio on/off {summary[key]['ratio_on_off'] and round(summary[key]['ratio_on_off'], 3)}")
    report = {"recipe": args.recipe, "backend": args.backend, "steps": args.steps, "runs": rows, "summary": summary}
    try:
        import torch
        import triton

        report["versions"] = {"torch": torch.__version__, "triton": triton.__version__,
                              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    except ImportError:
        pass
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
