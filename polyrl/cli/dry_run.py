"""``polyrl run RECIPE --dry-run [--nproc N] [--nnodes M] [--json] [--device-memory GIB]``.

Validates the recipe (types, cross-field checks, the data file when it is there, the world size the backend's
collective library accepts), resolves the backend by name *without its hardware* (a cuda plan is made on a
machine without a GPU), and prints the resolved config and the per-device memory plan
(:mod:`polyrl.core.plan`). Nothing is written, nothing is downloaded. A placement whose plan does not fit
raises ``BadInputError`` with one line saying what to change (exit 2), after the plan itself is printed, and
the smallest placement that fits (``polyrl.core.plan.placement``: nodes of ``--nproc`` devices and
``sharding.expert_parallel``), or what blocks every placement a run accepts, with how much. A recipe whose
``sharding.expert_parallel`` the world size refuses (it does not divide it) is still refused (exit 2), after the
plan of the nearest ep the world accepts and the smallest placement that fits are printed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from polyrl.core.config import RunConfig
    from polyrl.core.plugins.backend import Backend


def plan_backend(name: str | None) -> Backend:
    """The backend called ``name`` even when its hardware is absent; the selection rule when None."""
    from polyrl.core.plugins.registry import get_registry
    from polyrl.core.plugins.selection import resolve_backend

    name = name or os.environ.get("POLYRL_BACKEND") or None
    backends = get_registry().backends
    if name is not None and name in backends:
        return backends[name]
    return resolve_backend(name)  # unknown / not loaded: its one-line error; None: the rule


def dry_run(cfg: RunConfig, *, nproc: int = 1, nnodes: int = 1, as_json: bool = False,
            device_memory_gib: float | None = None) -> int:
    from polyrl.core.config import dump_config
    from polyrl.core.distributed.sharding import check_placement
    from polyrl.core.errors import BadInputError
    from polyrl.core.plan import plan_memory
    from polyrl.core.plan.placement import find_placement, nearest_expert_parallel
    from polyrl.core.trainer.setup import build_task

    backend = plan_backend(cfg.backend.name)
    if cfg.backend.name is None:
        cfg.backend.name = backend.name
    if nproc < 1 or nnodes < 1:
        raise BadInputError(f"--nproc and --nnodes must be >= 1, got {nproc} and {nnodes}")
    world = nproc * nnodes
    refused = None  # a placement refused for its expert parallelism alone: planned at the nearest ep accepted
    try:
        check_placement(cfg, backend, world)
    except BadInputError as exc:
        nearest = nearest_expert_parallel(cfg, backend, world)
        if nearest is None:
            raise
        refused, asked, cfg = exc, cfg, nearest
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
    # A placement that does not fit: the smallest one that does (nodes of --nproc devices, expert parallelism),
    # or what blocks every one a run accepts, and by how much.
    placement = (None if plan.fits and refused is None else
                 find_placement(cfg, backend, nproc=nproc, device_memory_gib=device_memory_gib, vocab_size=vocab))
    nearest_line = ""
    if refused is not None:
        ep = cfg.sharding.expert_parallel
        nearest_line = (f"sharding.expert_parallel={asked.sharding.expert_parallel} is refused on {world} device(s); "
                        f"the plan below is the nearest placement a run accepts: sharding.expert_parallel={ep} "
                        f"(peak {plan.peak_gib:.1f} of {plan.usable_gib:.1f} GiB usable: "
                        f"{'fits' if plan.fits else 'does NOT fit'})")
        cfg = asked  # the config printed is the recipe's own
    if as_json:
        doc = {"config": cfg.to_dict(), "memory_plan": plan.to_dict()}
        if refused is not None:
            doc["refused"] = str(refused)
            doc["memory_plan"]["expert_parallel"] = nearest.sharding.expert_parallel
        if placement is not None:
            doc["placement"] = placement.to_dict()
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    else:
        sys.stdout.write(dump_config(cfg))
        if nearest_line:
            sys.stdout.write(f"# {nearest_line}\n")
        sys.stdout.write("".join(f"# {line}\n" for line in plan.text().splitlines()))
        if placement is not None:
            sys.stdout.write("".join(f"# placement: {line}\n" for line in placement.text().splitlines()))
    sys.stdout.flush()
    if refused is not None:
        head = placement.text().splitlines()[0]
        verdict = "fits" if plan.fits else "does not fit"
        raise BadInputError(f"{refused}; nearest accepted: sharding.expert_parallel={nearest.sharding.expert_parallel} "
                            f"(peak {plan.peak_gib:.1f} of {plan.usable_gib:.1f} GiB usable: {verdict}); {head}")
    if placement is not None:
        head = placement.text().splitlines()[0]
        if not placement.fits:
            raise BadInputError(f"{plan.advice()}; {head}")
        raise BadInputError(f"memory plan: needs {plan.peak_gib:.1f} GiB per device, {plan.usable_gib:.1f} GiB usable "
                            f"on {plan.device} ({plan.backend}) with {plan.world_size} device(s); {head}")
    return 0
