"""``polyrl parity [--backend NAME] [--level op|model|step|recipe] [--dtype D] [--json]``.

Compares a backend with its references and prints measured error beside the bar: first the dtype it runs in
(the backend's own policy unless ``--dtype``) and what each level is compared against, then each row as soon as
it completes (the op level can take a minute or more on a device). Exit 0 when every
row that ran passed and at least one ran, 1 when any failed or nothing could run (a backend absent from
this machine is reported ``not run``, never as a pass), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json

from polyrl.testing.conformance import DTYPES
from polyrl.testing.parity import FAIL, LEVELS, PASS, REFERENCES, ParityRow


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="compare a backend with the CPU reference (op, model, step, recipe)")
    p.add_argument("--backend", default=None, help="backend to check (default: the selected one)")
    p.add_argument("--level", choices=LEVELS, action="append", help="level(s) to run (default: all)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="dtype to run in (default: the backend's own, its sharding policy's param_dtype)")
    p.add_argument("--emulate", action="store_true", help="run the backend on the CPU through its emulator (ascend)")
    p.add_argument("--json", action="store_true", help="print JSON at the end instead of rows as they complete")


def _print_row(r: ParityRow) -> None:
    err = "-" if r.error is None else f"{r.error:.2e}"
    bar = "-" if r.bar is None else f"{r.bar:.1e}"
    print(f"[{r.status:>7}] {r.level:<6} {r.case:<55} err {err:>9}  bar {bar:>7}  {r.detail}", flush=True)


def main(args: argparse.Namespace) -> int:
    from polyrl.core.plugins import list_backends
    from polyrl.core.plugins.selection import resolve_backend
    from polyrl.testing.parity import backend_dtype, run_parity

    if args.emulate:
        from polyrl.testing.emulation import enable_emulation

        enable_emulation(args.backend)
    if args.backend is not None and args.backend in list_backends():
        backend = list_backends()[args.backend]  # an unavailable backend is reported, not refused
    else:
        backend = resolve_backend(args.backend)  # unknown name -> BadInputError, exit 2
    levels = tuple(args.level or LEVELS)
    dtype = args.dtype or backend_dtype(backend)
    if args.json:
        rows = run_parity(backend, levels, dtype)
        print(json.dumps({"backend": backend.name, "dtype": dtype,
                          "references": {lv: REFERENCES[lv].format(dtype=dtype) for lv in levels},
                          "rows": [r.as_dict() for r in rows]}, indent=2))
    else:
        how = "given by --dtype" if args.dtype else "the backend's own dtype policy"
        print(f"parity of backend {backend.origin()} in {dtype} ({how})", flush=True)
        for level in levels:
            print(f"  {level:<6} compared against {REFERENCES[level].format(dtype=dtype)}")
        rows = run_parity(backend, levels, dtype, on_row=_print_row)
    ran = [r for r in rows if r.status in (PASS, FAIL)]
    return 0 if ran and not any(r.status == FAIL for r in rows) else 1
