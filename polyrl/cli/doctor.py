"""``polyrl doctor [--backend NAME] [--selfcheck] [--json]``: is this machine's stack consistent?

Asks every backend for its rows of the compatibility table (``Backend.compatibility()``: the distributions to
report, facts read from the machine, rules), reads installed versions from package metadata — never by importing
a vendor module, since a broken install would take doctor down with it — and runs core's vendor-free rules
(:mod:`polyrl.core.compat`) plus each backend's. Also reported as problems: a backend whose kernel paths do not
resolve, one whose ``detect()`` or ``compatibility()`` raises, and plugins that failed to load. Exit 0 healthy,
1 problems, 2 bad input.

``--selfcheck`` (with ``--backend``) then runs the backend's self-check on its device (``Backend.selfcheck_module``,
``python -m`` in a child process, its lines printed as they come; ascend: polyrl.backends.ascend.selfcheck). A backend
that is not available here is reported "not run", never as passed; the exit code is 1 when the check fails or
cannot run.
"""

from __future__ import annotations

import argparse
import json
import sys

from polyrl.core import compat
from polyrl.core.errors import BadInputError
from polyrl.core.plugins import Backend, get_registry
from polyrl.core.plugins.kernels import one_line


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check installed versions against polyrl's compatibility table")
    p.add_argument("--backend", default=None, help="check only this backend")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--selfcheck", action="store_true",
                   help="also run the backend's self-check on its device (needs --backend)")


def _rows(backend: Backend) -> tuple[compat.Compatibility, str]:
    try:
        rows = backend.introspection.compatibility()
        if not isinstance(rows, compat.Compatibility):
            raise TypeError(f"returned {type(rows).__name__}, not a polyrl.core.compat.Compatibility")
        return rows, ""
    except Exception as exc:  # a plugin's bug is reported, not raised
        return compat.Compatibility(), f"compatibility() raised {one_line(exc)}"


def _problem(component: str, message: str, advice: str) -> dict:
    return compat.Problem(component, message, advice).as_dict()


def _run_rules(rules: tuple, env: compat.Environment, name: str) -> list[dict]:
    try:
        return [p.as_dict() for p in compat.check(env, rules)]
    except Exception as exc:
        return [_problem(name, f"a compatibility rule of backend {name} raised {one_line(exc)}",
                         "report it to the plugin's authors")]


def diagnose(backend_filter: str | None = None) -> dict:
    registry = get_registry()
    if backend_filter is not None and backend_filter not in registry.backends:
        raise BadInputError(f"unknown backend {backend_filter!r}; installed backends: "
                            f"{', '.join(sorted(registry.backends))}")
    rows = {name: _rows(b) for name, b in registry.backends.items()}
    # Every backend's facts go into one environment: a rule may read another backend's fact (torch's CUDA build).
    facts = {k: v for r, _ in rows.values() for k, v in r.facts.items()}
    env = compat.read_environment(compat.CORE_COMPONENTS + tuple(c for r, _ in rows.values() for c in r.components),
                                  facts)
    core_problems = compat.check(env)
    report: dict = {"python": sys.version.split()[0], "backends": []}
    healthy = True
    for name in sorted(registry.backends):
        if backend_filter is not None and name != backend_filter:
            continue
        backend = registry.backends[name]
        mine, rows_error = rows[name]
        avail = backend.availability()
        components = compat.CORE_COMPONENTS + tuple(c for c in mine.components if c not in compat.CORE_COMPONENTS)
        problems = [p.as_dict() for p in compat.problems_about(core_problems, components)]
        problems += _run_rules(mine.rules, env, name)
        if rows_error:
            problems.append(_problem(name, rows_error, "report it to the plugin's authors"))
        # The kernels are imported only where the backend can run (vendor modules are importable there).
        for line in backend.declaration_problems(resolve=avail.available):
            problems.append(_problem(name, f"backend {name}: {line}", "fix the kernel path in the backend class"))
        # An unavailable backend is only a problem when the user asked about it explicitly.
        if backend_filter is not None and not avail.available and not backend.declaration_problems():
            problems.append(_problem(name, f"backend {name} is not available: {avail.reason}",
                                     f"install what the reason names, then run `polyrl doctor --backend {name}` again"))
        report["backends"].append({
            "name": name, "distribution": backend.distribution, "version": backend.version,
            "available": avail.available, "reason": avail.reason,
            "components": {**{c: env.versions.get(c) for c in components}, **dict(mine.facts)},
            "problems": problems,
        })
        healthy = healthy and not problems
    failed = [n.as_dict() for n in registry.failed]
    report["not_loaded"] = [n.as_dict() for _, n in sorted(registry.not_loaded.items())]
    report["healthy"] = healthy and not (failed and backend_filter is None)
    return report


def selfcheck(backend_name: str, *, capture: bool) -> dict:
    """Run ``backend_name``'s self-check module in a child process where the backend is available."""
    import os
    import subprocess

    backend = get_registry().backends[backend_name]
    module = backend.selfcheck_module
    if not module:
        raise BadInputError(f"--selfcheck: backend {backend_name!r} has no self-check")
    avail = backend.availability()
    if not avail.available:
        return {"module": module, "status": "not run", "returncode": None,
                "reason": f"backend {backend_name} is not available: {avail.reason}", "output": []}
    proc = subprocess.run([sys.executable, "-m", module], env=dict(os.environ), text=True,
                          capture_output=capture)
    return {"module": module, "status": "pass" if proc.returncode == 0 else "FAIL", "returncode": proc.returncode,
            "reason": "", "output": (proc.stdout + proc.stderr).splitlines() if capture else []}


def main(args: argparse.Namespace) -> int:
    if args.selfcheck and args.backend is None:
        raise BadInputError("--selfcheck needs --backend NAME (the backend whose device to check)")
    report = diagnose(args.backend)
    if args.selfcheck:
        if not args.json:  # the self-check's own lines come after the report, as they are printed
            _print(report)
            sys.stdout.flush()
        report["selfcheck"] = check = selfcheck(args.backend, capture=args.json)
        report["healthy"] = report["healthy"] and check["status"] == "pass"
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(f"self-check {check['module']}: {check['status']}" + (f" ({check['reason']})" if check["reason"] else ""))
            print("healthy" if report["healthy"] else "problems found")
        return 0 if report["healthy"] else 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
        print("healthy" if report["healthy"] else "problems found")
    return 0 if report["healthy"] else 1


def _print(report: dict) -> None:
    """The human-readable report (without the verdict line)."""
    for b in report["backends"]:
        state = "available" if b["available"] else f"not available: {b['reason']}"
        origin = " ".join(x for x in (b["distribution"], b["version"]) if x) or "registered in-process"
        print(f"[{b['name']}] ({origin}) {state}")
        for comp, ver in b["components"].items():
            print(f"    {comp:<14} {ver or '-'}")
        for p in b["problems"]:
            print(f"    PROBLEM {p['message']}\n        advice: {p['advice']}")
    for n in report["not_loaded"]:
        if n["failed"]:
            print(f"[plugin {n['name']}] ({n['distribution'] or '-'}) FAILED to load: {n['reason']}")
