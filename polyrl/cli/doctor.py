"""``polyrl doctor [--backend NAME] [--json]``: is this machine's stack consistent?

Reads installed versions from package metadata — never by importing torch_npu, vllm or triton, since a
broken install (torch_npu without CANN) would take doctor down with it — and checks them against the
compatibility table in :mod:`polyrl.core.compat`. Exit 0 healthy, 1 problems, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from importlib import metadata
from pathlib import Path

from polyrl.core import compat
from polyrl.core.errors import BadInputError
from polyrl.core.plugins import get_registry


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check installed versions against polyrl's compatibility table")
    p.add_argument("--backend", default=None, help="check only this backend")
    p.add_argument("--json", action="store_true", help="print JSON")


def _torch_cuda_version() -> str | None:
    """torch.version.cuda, read from torch/version.py's text so that a broken torch cannot crash us."""
    try:
        path = metadata.distribution("torch").locate_file("torch/version.py")
        text = Path(str(path)).read_text()
    except (metadata.PackageNotFoundError, OSError):
        return None
    m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return m.group(1) if m else None


def _cann_version() -> str | None:
    from polyrl.backends.ascend import cann_home

    home = cann_home()
    if home is None:
        return None
    for name in ("ascend_toolkit_install.info", "version.cfg", "version.info"):
        for path in Path(home).glob(f"**/{name}"):
            try:
                found = compat.parse_cann_version(path.read_text(errors="replace"))
            except OSError:
                continue
            if found:
                return found
    return "unknown"


def read_environment() -> compat.Environment:
    versions: dict[str, str] = {}
    requires: dict[str, list[str]] = {}
    for dist in compat.COMPONENTS:
        try:
            versions[dist] = metadata.version(dist)
            requires[dist] = list(metadata.requires(dist) or [])
        except metadata.PackageNotFoundError:
            continue
    return compat.Environment(versions=versions, requires=requires, cann_version=_cann_version(),
                              torch_cuda=_torch_cuda_version())


def diagnose(backend_filter: str | None = None) -> dict:
    registry = get_registry()
    if backend_filter is not None and backend_filter not in registry.backends:
        raise BadInputError(f"unknown backend {backend_filter!r}; installed backends: "
                            f"{', '.join(sorted(registry.backends))}")
    env = read_environment()
    problems = compat.check(env)
    report: dict = {"python": sys.version.split()[0], "backends": []}
    healthy = True
    for name in sorted(registry.backends):
        if backend_filter is not None and name != backend_filter:
            continue
        backend = registry.backends[name]
        avail = backend.detect()
        mine = compat.problems_for_backend(problems, name)
        components = {c: env.versions.get(c) for c in compat.BACKEND_COMPONENTS.get(name, compat.COMPONENTS)
                      if c != "cann"}
        if name == "ascend":
            components["cann"] = env.cann_version
        entry = {
            "name": name, "available": avail.available, "reason": avail.reason,
            "components": components, "problems": [p.as_dict() for p in mine],
        }
        # An unavailable backend is only a problem when the user asked about it explicitly.
        if backend_filter is not None and not avail.available:
            entry["problems"].append({"component": name, "message": f"backend {name} is not available: {avail.reason}",
                                      "advice": "see the backend's install notes in README.md", "backends": [name]})
        healthy = healthy and not entry["problems"]
        report["backends"].append(entry)
    report["healthy"] = healthy
    return report


def main(args: argparse.Namespace) -> int:
    report = diagnose(args.backend)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for b in report["backends"]:
            state = "available" if b["available"] else f"not available: {b['reason']}"
            print(f"[{b['name']}] {state}")
            for comp, ver in b["components"].items():
                print(f"    {comp:<14} {ver or '-'}")
            for p in b["problems"]:
                print(f"    PROBLEM {p['message']}\n        advice: {p['advice']}")
        print("healthy" if report["healthy"] else "problems found")
    return 0 if report["healthy"] else 1
