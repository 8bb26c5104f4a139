"""``polyrl parity [--backend NAME] [--level op|model|step|recipe] [--json]``.

Compares a backend with the CPU reference and prints measured error beside the bar. Exit 0 when every
row that ran passed and at least one ran, 1 when any failed or nothing could run (a backend absent from
this machine is reported ``not run``, never as a pass), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json

from polyrl.testing.parity import FAIL, LEVELS, PASS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="compare a backend with the CPU reference (op, model, step, recipe)")
    p.add_argument("--backend", default=None, help="backend to check (default: the selected one)")
    p.add_argument("--level", choices=LEVELS, action="append", help="level(s) to run (default: all)")
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    from polyrl.core.plugins import list_backends
    from polyrl.core.plugins.selection import resolve_backend
    from polyrl.testing.parity import run_parity

    if args.backend is not None and args.backend in list_backends():
        backend = list_backends()[args.backend]  # an unavailable backend is reported, not refused
    else:
        backend = resolve_backend(args.backend)  # unknown name -> BadInputError, exit 2
    rows = run_parity(backend, tuple(args.level or LEVELS))
    if args.json:
        print(json.dumps({"backend": backend.name, "rows": [r.as_dict() for r in rows]}, indent=2))
    else:
        print(f"parity of backend {backend.name!r} against the cpu reference (fp32)")
        for r in rows:
            err = "-" if r.error is None else f"{r.error:.2e}"
            bar = "-" if r.bar is None else f"{r.bar:.0e}"
            print(f"[{r.status:>7}] {r.level:<6} {r.case:<55} err {err:>9}  bar {bar:>6}  {r.detail}")
    ran = [r for r in rows if r.status in (PASS, FAIL)]
    return 0 if ran and not any(r.status == FAIL for r in rows) else 1
