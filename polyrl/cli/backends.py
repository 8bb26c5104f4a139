"""``polyrl backends [--json]``: what backends are installed, where from, and whether they can run here."""

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
        "not_loaded": [{"name": n, "reason": why} for n, why in sorted(registry.skipped.items())],
    }


def main(args: argparse.Namespace) -> int:
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"{'backend':<10} {'version':<9} {'from':<18} {'available':<10} details")
    for b in data["backends"]:
        status = "yes" if b["available"] else "no"
        detail = b["reason"] if not b["available"] else f"device={b['device_type']} collectives={b['collective_backend']}"
        print(f"{b['name']:<10} {b['version']:<9} {b['distribution']:<18} {status:<10} {detail}")
        print(f"{'':<10} capabilities: {', '.join(b['capabilities']) or '-'}")
        print(f"{'':<10} kernels falling back to the reference: {', '.join(b['kernels_fallback']) or 'none'}")
    for s in data["not_loaded"]:
        print(f"{s['name']:<10} (installed, not loaded: {s['reason']})")
    return 0
