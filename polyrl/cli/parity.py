"""``polyrl parity [--backend NAME] [--level op|model|step|recipe] [--dtype D] [--emulate] [--json]
[--steps N] [--seeds S,S] [--jobs J] [--plot FILE.png] [--output FILE.json]``.

Compares a backend with its references and prints measured error beside the bar: first the dtype it runs in
(the backend's own policy unless ``--dtype``) and what each level is compared against, then each row as soon as
it completes (the op level can take a minute or more on a device). ``--json`` prints one object with a key per
level (its reference, summary status and rows; the recipe level's rows carry the curves), ``--output`` writes
that object to a file as well, ``--plot`` draws the recipe level's seed-averaged reward and loss curves
(matplotlib; also from a saved report: ``polyrl parity --plot-from report.json --plot out.png``). Exit 0 when
every row that ran passed and at least one ran, 1 when any failed or nothing could run (a backend absent from
this machine is reported ``not run``, never as a pass), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from polyrl.parity import DTYPES, FAIL, LEVELS, PASS, REFERENCES, ParityRow, parity_report


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="compare a backend with the CPU reference (op, model, step, recipe)")
    p.add_argument("--backend", default=None, help="backend to check (default: the selected one)")
    p.add_argument("--level", choices=LEVELS, action="append", help="level(s) to run (default: all)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="dtype to run in (default: op/model the backend's own, its sharding policy's param_dtype; "
                        "step/recipe the recipe's model.dtype)")
    p.add_argument("--emulate", action="store_true", help="run the backend on the CPU through its emulator (ascend)")
    p.add_argument("--json", action="store_true", help="print JSON at the end instead of rows as they complete")
    _add_report_options(p)


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"expected distinct seeds, got {text!r}")
    return seeds


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _add_report_options(p: argparse.ArgumentParser) -> None:
    from polyrl.parity import DEFAULT_SEEDS, DEFAULT_STEPS

    p.add_argument("--steps", type=_positive, default=None,
                   help=f"recipe level: training steps per run (default {DEFAULT_STEPS})")
    p.add_argument("--seeds", type=_seeds, default=None,
                   help=f"recipe level: seeds, comma-separated (default {','.join(map(str, DEFAULT_SEEDS))})")
    p.add_argument("--jobs", type=_positive, default=2, help="recipe level: runs at a time (default 2)")
    p.add_argument("--output", default=None, metavar="FILE.json", help="write the JSON report to this file too")
    p.add_argument("overrides", nargs="*", metavar="key.path=value",
                   help="step and recipe levels: changes to both tiny recipes, on both sides of the comparison "
                        "(e.g. model.lora.enabled=true 'model.lora.target_modules=[lm_head]')")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw the recipe level's seed-averaged reward and loss curves (needs matplotlib)")
    p.add_argument("--plot-from", default=None, metavar="REPORT.json",
                   help="only draw --plot from a saved report (--output or --json); run nothing")


def _print_row(r: ParityRow) -> None:
    err = "-" if r.error is None else f"{r.error:.2e}"
    bar = "-" if r.bar is None else f"{r.bar:.1e}"
    print(f"[{r.status:>7}] {r.level:<6} {r.case:<55} err {err:>9}  bar {bar:>7}  {r.detail}", flush=True)


def main(args: argparse.Namespace) -> int:
    from polyrl.core.errors import BadInputError
    from polyrl.core.plugins import list_backends
    from polyrl.core.plugins.selection import resolve_backend
    from polyrl.parity import backend_dtype, run_parity

    if args.plot_from:
        return _plot_only(args)
    if args.emulate:
        from polyrl.emulation import enable_emulation

        enable_emulation(args.backend)
    if args.backend is not None and args.backend in list_backends():
        backend = list_backends()[args.backend]  # an unavailable backend is reported, not refused
    else:
        backend = resolve_backend(args.backend)  # unknown name -> BadInputError, exit 2
    levels = tuple(args.level or LEVELS)
    if args.plot and "recipe" not in levels:
        raise BadInputError("--plot draws the recipe level's curves: add --level recipe (or leave --level out)")
    if args.plot:
        _check_matplotlib()
    for path in (args.output, args.plot):  # found missing now, not after the runs
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    dtype = args.dtype or backend_dtype(backend)
    emulate = bool(args.emulate)
    overrides = tuple(args.overrides or ())
    if overrides:  # a bad override is refused now (exit 2), not after the other levels ran
        from polyrl.core.config import load_config
        from polyrl.parity.train import TINY_RECIPES, _recipe_spec

        for recipe in TINY_RECIPES:
            load_config(_recipe_spec(recipe), list(overrides))
    options = dict(steps=args.steps, seeds=args.seeds, emulate=emulate, jobs=args.jobs, overrides=overrides)
    if args.json:
        rows = run_parity(backend, levels, args.dtype, **options)
    else:
        how = "given by --dtype" if args.dtype else "the backend's own dtype policy"
        print(f"parity of backend {backend.introspection.origin()} in {dtype} ({how}){' on its emulator' if emulate else ''}",
              flush=True)
        for level in levels:
            print(f"  {level:<6} compared against {REFERENCES[level].format(dtype=dtype)}")
        rows = run_parity(backend, levels, args.dtype, on_row=_print_row, **options)
    report = parity_report(backend, dtype, rows, levels, emulated=emulate)
    if overrides:
        report["overrides"] = list(overrides)
    if args.json:
        print(json.dumps(report, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        from polyrl.parity.plot import plot_recipe_curves, recipe_curves

        if recipe_curves(report):
            plot_recipe_curves(report, args.plot)
        else:
            print(f"polyrl parity: --plot {args.plot}: not drawn, the recipe level has no curves", file=sys.stderr)
    ran = [r for r in rows if r.status in (PASS, FAIL)]
    return 0 if ran and not any(r.status == FAIL for r in rows) else 1


def _check_matplotlib() -> None:
    from polyrl.core.errors import BadInputError

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BadInputError("--plot needs matplotlib: pip install 'polyrl[report]'") from None


def _plot_only(args: argparse.Namespace) -> int:
    from polyrl.core.errors import BadInputError
    from polyrl.parity.plot import plot_recipe_curves

    if not args.plot:
        raise BadInputError("--plot-from needs --plot FILE.png")
    try:
        report = json.loads(Path(args.plot_from).read_text())
    except (OSError, ValueError) as exc:
        raise BadInputError(f"--plot-from {args.plot_from}: cannot read a parity report ({exc})") from None
    plot_recipe_curves(report, args.plot)
    return 0
