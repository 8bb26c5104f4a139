"""Where a whole ``polyrl run`` spends its wall time, from a py-spy recording: start-up, the steps, checkpoints, exit.

The tiny recipes' wall bars include everything the process does, and on a GPU most of what is not a step is
start-up (issue 40). ``bench/profile_step.py`` times the trainer's build from inside one process; this reads a
sampling profile of the real command, so interpreter start, imports, the CLI, the build, every step, every
checkpoint and the exit are all counted, by the same clock:

    py-spy record --idle -r 100 -f raw -o spy.txt -- python -m polyrl run recipes/gpt_oss_dapo_tiny.yaml \\
        --backend cuda --output /tmp/run --no-progress
    python bench/spy_split.py spy.txt [--rate 100] [--out split.json]

Record with ``--idle`` so that time the process spends waiting (a GPU sync, file I/O) is counted too; without it
the phases add up to the busy time only. Each sample is put in the first phase, outermost first, whose marker
frame it holds (PHASES); the build, the steps and the CLI's parts are also split by their direct callees (SPLIT).
Prints seconds and shares; exit 2 on a file that is not py-spy's raw format.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

# (phase, function, file): a sample whose stack holds a frame of ``function`` in a file whose path ends with
# ``file`` belongs to the phase. Checked in this order; a sample matching none is "other".
PHASES: tuple[tuple[str, str, str], ...] = (
    ("trainer build", "Trainer.__init__", "polyrl/core/trainer/loop.py"),
    ("checkpoints", "Trainer.save", "polyrl/core/trainer/loop.py"),
    ("steps", "Trainer.step", "polyrl/core/trainer/loop.py"),
    ("train, outside steps", "Trainer.train", "polyrl/core/trainer/loop.py"),
    ("run process, outside train", "_run_process", "polyrl/cli/run.py"),
    ("cli before the run", "main", "polyrl/cli/run.py"),
    ("interpreter start and imports", "<module>", ""),
)
# phase -> the frame whose direct callees split it
SPLIT = {"trainer build": ("build_components", "polyrl/core/trainer/setup.py"),
         "steps": ("Trainer.step", "polyrl/core/trainer/loop.py"),
         "run process, outside train": ("_run_process", "polyrl/cli/run.py"),
         "cli before the run": ("main", "polyrl/cli/run.py")}


class BadProfile(ValueError):
    pass


def parse_frame(frame: str) -> tuple[str, str]:
    """``"func (path/file.py:12)"`` -> ``("func", "path/file.py")``."""
    name, sep, where = frame.rpartition(" (")
    if not sep:
        return frame, ""
    return name, where.rstrip(")").rsplit(":", 1)[0]


def read_raw(path: Path) -> list[tuple[list[tuple[str, str]], int]]:
    """py-spy's raw (collapsed-stack) format: one ``frame;frame;... count`` line per distinct stack, outermost first."""
    stacks = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        stack, sep, count = line.rpartition(" ")
        if not sep or not count.isdigit():
            raise BadProfile(f"{path}:{n} is not a py-spy raw line ('frame;frame;... count')")
        # an empty stack: samples with no Python frame (the interpreter starting, or native code only)
        stacks.append(([parse_frame(f) for f in stack.split(";")] if stack.strip() else [], int(count)))
    if not stacks:
        raise BadProfile(f"{path} holds no samples")
    return stacks


def _holds(frames: list[tuple[str, str]], func: str, file: str) -> int | None:
    for i, (name, where) in enumerate(frames):
        if name == func and where.endswith(file):
            return i
    return None


def split(stacks: list[tuple[list[tuple[str, str]], int]], rate: float) -> dict:
    """Seconds per phase, and per direct callee of each phase in SPLIT."""
    phases: Counter[str] = Counter()
    callees: dict[str, Counter[str]] = {k: Counter() for k in SPLIT}
    for frames, count in stacks:
        phase = "other" if frames else "no Python frame"
        for name, func, file in PHASES:
            if _holds(frames, func, file) is not None:
                phase = name
                break
        phases[phase] += count
        if phase in SPLIT:
            i = _holds(frames, *SPLIT[phase])
            below = frames[i + 1] if i is not None and i + 1 < len(frames) else ("(itself)", "")
            callees[phase][f"{below[0]} ({below[1].rsplit('/', 1)[-1]})" if below[1] else below[0]] += count
    total = sum(phases.values())
    return {
        "rate_hz": rate, "samples": total, "seconds": total / rate,
        "phases": {k: round(v / rate, 3) for k, v in phases.most_common()},
        "callees": {k: {c: round(n / rate, 3) for c, n in v.most_common(8)} for k, v in callees.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", help="py-spy record -f raw output")
    ap.add_argument("--rate", type=float, default=100.0, help="the sampling rate it was recorded at (-r), Hz")
    ap.add_argument("--out", default=None, help="write the split as JSON here")
    args = ap.parse_args(argv)
    if args.rate <= 0:
        print(f"spy_split: error: --rate must be positive, got {args.rate}", file=sys.stderr)
        return 2
    try:
        res = split(read_raw(Path(args.profile)), args.rate)
    except (OSError, UnicodeDecodeError, BadProfile) as exc:
        print(f"spy_split: error: {exc}", file=sys.stderr)
        return 2
    res["profile"] = args.profile
    print(f"{res['seconds']:.2f} s sampled ({res['samples']} samples at {args.rate:g} Hz)")
    for phase, s in res["phases"].items():
        print(f"  {phase:<32} {s:8.2f} s  {s / res['seconds']:6.1%}")
    for phase, parts in res["callees"].items():
        if parts:
            print(f"{phase}, by direct callee:")
            for name, s in parts.items():
                print(f"  {name:<60} {s:8.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
