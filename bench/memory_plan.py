"""The dry-run memory plan against a measured peak: ``polyrl run RECIPE --dry-run --json`` and then the same recipe
for a few steps, on the same backend; prints the plan's peak beside the measured ``memory/peak_gib`` (the largest
over the steps after the first) and their ratio, and writes JSON.

    python bench/memory_plan.py [--recipe recipes/gpt_oss_dapo_2layer.yaml] [--backend cuda] [--device-memory 141]
                                [--out bench/results/memory_plan.json] [key=value ...]

The bar (issue 20): measured within 15% of the plan. A backend without a device memory metric (cpu) reports the
measurement as absent, never as passed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BAR = 0.15


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/gpt_oss_dapo_2layer.yaml")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--device-memory", default="141")
    ap.add_argument("--out", default="bench/results/memory_plan.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    base = [sys.executable, "-m", "polyrl", "run", args.recipe, "--backend", args.backend, *args.overrides]
    dry = subprocess.run([*base, "--dry-run", "--json", "--device-memory", args.device_memory],
                         capture_output=True, text=True)
    if dry.returncode not in (0, 2):
        print(dry.stderr[-2000:])
        return 1
    plan = json.loads(dry.stdout)["memory_plan"]
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "run"
        t0 = time.time()
        run = subprocess.run([*base, "--output", str(out), "--no-progress"], capture_output=True, text=True)
        wall = time.time() - t0
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()] \
            if (out / "metrics.jsonl").exists() else []
    peaks = [r["memory/peak_gib"] for r in rows[1:] if "memory/peak_gib" in r]
    measured = max(peaks) if peaks else None
    ratio = measured / plan["peak_gib"] if measured else None
    result = {
        "recipe": args.recipe, "backend": args.backend, "overrides": args.overrides, "rc": run.returncode,
        "wall_s": round(wall, 1), "plan_peak_gib": plan["peak_gib"], "plan_phases": plan["phases"],
        "plan_rows": plan["rows"], "measured_peak_gib": measured, "measured_per_step": [r.get("memory/peak_gib") for r in rows],
        "ratio_measured_over_plan": ratio, "bar": BAR,
        "within_bar": None if ratio is None else abs(ratio - 1) <= BAR,
    }
    print(f"{'recipe':<40} {'plan GiB':>9} {'measured GiB':>13} {'ratio':>7}  bar ±{BAR:.0%}")
    shown = f"{measured:13.2f}" if measured is not None else f"{'absent':>13}"
    print(f"{args.recipe:<40} {plan['peak_gib']:9.2f} {shown} {ratio or float('nan'):7.3f}  "
          f"{'within' if result['within_bar'] else ('not measured' if ratio is None else 'OUTSIDE')}")
    if run.returncode != 0:
        print(run.stderr[-2000:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if run.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
