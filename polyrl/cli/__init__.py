"""The ``polyrl`` command: a thin argparse front over polyrl's modules.

Each sub-command lives in its own module exposing ``add_parser(subparsers)`` and ``main(args) -> int``.
Exit codes: 0 success, 1 anything else, 2 bad input — a one-line message on stderr, no
traceback, nothing on disk touched. Sub-command modules raise ``BadInputError`` for bad input and this
front turns it into the message and the code; a fault of the machine (``Fault``: a full disk, ...) is one
line too, with exit 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from polyrl.core.errors import BadInputError
from polyrl.core.run.faults import Fault

# name -> module under polyrl.cli. Every module is imported to build the parser, so each keeps its top level
# light and imports the heavy parts (torch, the trainer) inside its ``main``: `polyrl backends` never pays for them.
COMMANDS: dict[str, str] = {
    "run": "polyrl.cli.run",
    "backends": "polyrl.cli.backends",
    "doctor": "polyrl.cli.doctor",
    "parity": "polyrl.cli.parity",
    "report": "polyrl.cli.report",
    "export": "polyrl.cli.export",
}

EXIT_BAD_INPUT = 2  # argparse's own code for bad usage, so every bad input exits alike


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, object]]:
    parser = argparse.ArgumentParser(prog="polyrl", description="RL post-training across CPU, NVIDIA GPUs and Ascend NPUs")
    from polyrl import __version__

    parser.add_argument("--version", action="version", version=f"polyrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    modules: dict[str, object] = {}
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_parser(sub)
        modules[name] = module
    return parser, modules


def main(argv: Sequence[str] | None = None) -> int:
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    module = modules[args.command]
    try:
        return int(module.main(args) or 0)
    except BadInputError as exc:
        print(f"polyrl {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Fault as exc:
        print(f"polyrl {args.command}: error: {exc}", file=sys.stderr)
        return 1  # a fault of the machine: not bad input
    except KeyboardInterrupt:
        print(f"polyrl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
