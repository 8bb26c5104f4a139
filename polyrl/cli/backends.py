"""``polyrl backends [--json]``: what backends are installed, where from, and whether they can run here.

For each backend: its distribution and version, whether it is available (``detect()``, isolated: an error in a
plugin is an unavailable backend with the error's line) and healthy (its kernel paths resolve), the kernels it
runs (``native`` when it provides them, else the reference) and, for a kernel that picks an implementation per call
(the cuda backend's attention: FlashAttention-4 or Triton), what runs in each case and why (``kernel_choices``),
its capabilities (unknown names are warned about), and its rollout engines in order of preference
(``rollout.engine: auto`` takes the first that can run), each with the reason it cannot run here when it cannot.
Plugins that were found but not loaded — a loading rule, or an import / registration that failed — are listed
with their distribution and the reason. Exit 0, also when a plugin is broken: this is the command that says so.
"""

from __future__ import annotations

import argparse
import json

from polyrl.core.plugins import get_registry


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("backends", help="list installed backends, their availability and kernel fallbacks")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def collect() -> dict:
    registry = get_registry()
    return {
        "backends": [registry.backends[name].describe() for name in sorted(registry.backends)],
        "not_loaded": [n.as_dict() for _, n in sorted(registry.not_loaded.items())],
    }


def main(args: argparse.Namespace) -> int:
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"{'backend':<10} {'version':<9} {'from':<22} {'available':<10} details")
    for b in data["backends"]:
        status = "yes" if b["available"] else "no"
        kind = "accelerator" if b["is_accelerator"] else "reference" if b["is_reference"] else "not an accelerator"
        detail = b["reason"] if not b["available"] else \
            f"device={b['device_type']} collectives={b['collective_backend']} ({kind})"
        print(f"{b['name']:<10} {b['version'] or '-':<9} {b['distribution'] or '(in-process)':<22} {status:<10} {detail}")
        print(f"{'':<10} capabilities: {', '.join(b['capabilities']) or '-'}")
        engines = [f"{e} ({why})" if why else e for e, why in b["rollout_engine_problems"].items()]
        print(f"{'':<10} rollout engines (preferred first): {', '.join(engines) or '-'}")
        for kernel, path in b["kernels"].items():
            how = "reference" if b["is_reference"] or kernel not in b["native_kernels"] else "native"
            print(f"{'':<10} {kernel}: {how} ({path})")
            for case, what in b.get("kernel_choices", {}).get(kernel, {}).items():
                print(f"{'':<10}   {case}: {what}")
        for line in b["problems"]:
            print(f"{'':<10} PROBLEM {line}")
        for line in b["warnings"]:
            print(f"{'':<10} warning: {line}")
    for n in data["not_loaded"]:
        state = "FAILED" if n["failed"] else "not loaded"
        print(f"{n['name']:<10} {'':<9} {n['distribution'] or '-':<22} {state}: {n['reason']}")
    return 0
