"""``polyrl run RECIPE --dry-run [--nproc N] [--nnodes M] [--json] [--device-memory GIB]``.

Validates the recipe (types, cross-field checks, the data file when it is there, the world size the backend's
collective library accepts), resolves the backend by name *without its hardware* (a cuda plan is made on a
machine without a GPU), and prints the resolved config and the per-device memory plan
(:mod:`polyrl.core.plan`). Nothing is written, nothing is downloaded. A placement whose plan does not fit
raises ``BadInputError`` with one line saying what to change (exit 2), after the plan itself is printed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def plan_backend(name: str | None) -> Any:
    """The backend called ``name`` even when its hardware is absent; the selection rule when None."""
    from polyrl.core.plugins.registry import get_registry
    from polyrl.core.plugins.selection import resolve_backend

    name = name or os.environ.get("POLYRL_BACKEND") or None
    backends = get_registry().backends
    if name is not None and name in backends:
        return backends[name]
    return resolve_backend(name)  # unknown / not loaded: its one-line error; None: the rule


def dry_run(cfg: Any, *, nproc: int = 1, nnodes: int = 1, as_json: bool = False,
            device_memory_gib: float | None = None) -> int:
    from polyrl.core.config import dump_config
    from polyrl.core.distributed.sharding import check_placement
    from polyrl.core.errors import BadInputError
    from polyrl.core.plan import plan_memory
    from polyrl.core.trainer.setup import build_task

    backend = plan_backend(cfg.backend.name)
    if cfg.backend.name is None:
        cfg.backend.name = backend.name
    if nproc < 1 or nnodes < 1:
        raise BadInputError(f"--nproc and --nnodes must be >= 1, got {nproc} and {nnodes}")
    world = nproc * nnodes
    check_placement(cfg, backend, world)
    vocab = None
    if cfg.data.path is not None and not Path(cfg.data.path).exists():  # inspect a recipe before the download
        print(f"polyrl run: data.path {cfg.data.path}: not checked: file absent", file=sys.stderr)
    else:
        task = build_task(cfg)  # the data file and its rows are validated too
        if task.vocab() and cfg.model.tokenizer is None:  # the trainer sizes the embeddings to the tiny vocabulary
            from polyrl.core.models.tokenizer import build_tiny_tokenizer

            vocab = len(build_tiny_tokenizer(task.vocab()))
    plan = plan_memory(cfg, backend, nproc=nproc, nnodes=nnodes, device_memory_gib=device_memory_gib,
                       vocab_size=vocab)
    if as_json:
        sys.stdout.write(json.dumps({"config": cfg.to_dict(), "memory_plan": plan.to_dict()}, indent=1) + "\n")
    else:
        sys.stdout.write(dump_config(cfg))
        sys.stdout.write("".join(f"# {line}\n" for line in plan.text().splitlines()))
    sys.stdout.flush()
    if not plan.fits:
        raise BadInputError(plan.advice())
    return 0
