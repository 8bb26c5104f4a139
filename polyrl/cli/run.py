"""``polyrl run RECIPE [--backend NAME] [--output DIR] [--seed N] [--nproc N] [--resume-from step_N] [--dry-run] [--emulate] [key.path=value ...]``

A launcher: parse, choose the backend, lock the run directory, start the processes, report. The run is
``Trainer.train()``; the process around it is :mod:`polyrl.core.distributed.process` / ``.launch``. Exit 2 needs
order: recipe, backend and trainer are built before the run directory is locked or touched. Under ``--nproc``
this process holds the lock and its workers die with it; a stop signal ends every process (exit 128+N).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from polyrl.core.config import RunConfig
    from polyrl.core.plugins.backend import Backend

STOP_SIGNUMS = (2, 15, 1)  # SIGINT, SIGTERM, SIGHUP: the user's stop (one line says how to resume)


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=None, help="backend name (default: the selection rule)")
    p.add_argument("--output", default=None, help="run directory (default: runs/<recipe>-<time>); reused = resume")
    p.add_argument("--seed", type=int, default=None, help="seed of every random source (= trainer.seed=N)")
    p.add_argument("--nproc", type=int, default=1, help="local processes (torchrun, FSDP2)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of --nproc processes each (the --dry-run plan)")
    p.add_argument("--dry-run", action="store_true", help="validate, print the config and memory plan; run nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: one JSON object {config, memory_plan}")
    p.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                   help="with --dry-run: memory of one device (default: the backend's table)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--resume-from", default=None, metavar="step_N", help="resume from this checkpoint of --output "
                   "(step_N, N, or its path) instead of the newest; newer ones are set aside")
    p.add_argument("--emulate", action="store_true",
                   help="run the backend's real code on the CPU through its emulator (ascend; not a device run)")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run", help="train a recipe", description=__doc__.split("\n\n")[0],
        epilog="RECIPE is a path or a packaged recipe (recipes/gpt_oss_dapo_tiny.yaml works from any directory).",
    )
    p.add_argument("recipe", metavar="RECIPE")
    _add_options(p)
    # Overrides may come before or after the options; they are separated from them in main().
    p.add_argument("overrides", nargs=argparse.REMAINDER, metavar="key.path=value")
    return p


def _split_remainder(args: argparse.Namespace) -> argparse.Namespace:
    """Options that came after the first override (argparse leaves them in the remainder) are parsed here."""
    rest = argparse.ArgumentParser(prog="polyrl run", add_help=False)
    _add_options(rest)
    rest.add_argument("overrides", nargs="*")
    defaults = {a.dest: a.default for a in rest._actions if a.dest != "overrides"}
    ns = rest.parse_intermixed_args(args.overrides or [])
    for key, default in defaults.items():
        value = getattr(ns, key)
        if value != default:
            setattr(args, key, value)
    args.overrides = list(ns.overrides)
    return args


def _output(args: argparse.Namespace) -> Path:
    from polyrl.core.run.directory import default_run_dir

    return Path(args.output) if args.output else default_run_dir(Path(args.recipe).name.removesuffix(".yaml").removesuffix(".yml"))


def main(args: argparse.Namespace) -> int:
    args = _split_remainder(args)
    from polyrl.core.distributed import process as P

    P.apply_openmp_policy(choose_wait=not args.dry_run)  # before torch loads: a dry run computes no tensors
    from polyrl.core import distributed as D
    from polyrl.core.config import load_config
    from polyrl.core.errors import BadInputError
    from polyrl.core.plugins.selection import resolve_backend

    if args.emulate:
        from polyrl.emulation import enable_emulation

        enable_emulation(args.backend)
    overrides = [*args.overrides, *([f"trainer.seed={args.seed}"] if args.seed is not None else []),
                 *([f"backend.name={args.backend}"] if args.backend is not None else [])]
    cfg = load_config(args.recipe, overrides)
    if args.dry_run:
        from polyrl.cli.dry_run import dry_run

        return dry_run(cfg, nproc=args.nproc, nnodes=args.nnodes, as_json=args.json, device_memory_gib=args.device_memory)
    if args.nnodes != 1 or args.json or args.device_memory is not None:  # a multi-node run: torchrun per node
        raise BadInputError("--nnodes, --json and --device-memory go with --dry-run")
    backend = resolve_backend(cfg.backend.name)  # passed down and bound where models are built, never global
    cfg.backend.name = backend.name  # the resolved config names what actually ran
    if args.nproc > 1 and not D.under_torchrun():
        return _launch(args, cfg, backend)
    return _run_process(args, cfg, backend)


def _launch(args: argparse.Namespace, cfg: RunConfig, backend: Backend) -> int:
    """Validate what needs no process group (bad input: exit 2), lock the run directory until the last worker has
    ended (rank 0 recognises its launcher as the holder), run ``--nproc`` torchrun workers, say how it ended."""
    from polyrl.core.distributed.launch import launch_torchrun
    from polyrl.core.run.checkpoint import check_resume
    from polyrl.core.run.directory import RunLock, check_unlocked
    from polyrl.core.run.outcome import last_logged_step, resume_point, stopped_message
    from polyrl.core.trainer.setup import check_before_launch

    out = _output(args)
    check_unlocked(out)  # a live run there: refuse before the setup below
    check_before_launch(cfg, backend, args.nproc)  # task and data, checkpoint formats, world size, sharding
    check_resume(out / "checkpoints", args.resume_from)  # a refused checkpoint: one line, before any worker
    argv = ["run", args.recipe, *args.overrides, "--output", str(out)]  # every rank writes the same directory
    for flag, value in (("--backend", args.backend), ("--seed", args.seed), ("--resume-from", args.resume_from)):
        argv += [flag, str(value)] if value is not None else []
    lock, code = RunLock.acquire(out), 1
    argv += ["--no-progress"] * args.no_progress + ["--emulate"] * args.emulate
    try:
        code = launch_torchrun(argv, args.nproc)
    finally:
        lock.release(undo=code == 2)  # bad input seen by a worker: nothing was written, leave no trace
    if code - 128 in STOP_SIGNUMS:
        from polyrl.core.distributed.launch import signal_name  # the launcher outlives every worker: it says it

        print(f"polyrl run: {stopped_message(signal_name(code - 128), last_logged_step(out), out / 'checkpoints')}",
              file=sys.stderr)
    elif code not in (0, 2):  # a worker failed (rank 0 may be the one gone)
        print(f"polyrl run: the same command {resume_point(out / 'checkpoints')}", file=sys.stderr)
    return code


def _run_process(args: argparse.Namespace, cfg: RunConfig, backend: Backend) -> int:
    """One process of the run: lifeline, signals, process group, trainer, lock, ``Trainer.train()``, exit code."""
    from polyrl.core import distributed as D
    from polyrl.core.distributed import launch as L
    from polyrl.core.distributed import process as P
    from polyrl.core.errors import BadInputError
    from polyrl.core.run.directory import RunDir, check_unlocked, lock_run_dir
    from polyrl.core.run.outcome import stopped_message
    from polyrl.core.run.report import events_missing
    from polyrl.core.trainer import RunFault, RunStopped, Trainer, TrainingAborted

    worker = D.under_torchrun()
    if worker:
        L.worker_lifeline()  # die with torchrun's agent and with the `polyrl run --nproc` launcher
    restore = [L.install_stop_handlers(), P.pin_determinism(backend)]  # SIGINT/SIGTERM/SIGHUP: stop where we are

    def say(msg: str) -> None:  # rank 0 speaks for the run
        if D.is_main_process():
            print(f"polyrl run: {msg}", file=sys.stderr)

    lock, run_dir, alone = None, None, False
    try:
        if args.output and not worker:
            check_unlocked(args.output)  # a live run there: refuse before building anything
        D.init_distributed(backend)
        if D.is_distributed():  # a peer worker of this host that ends mid-run ends this one at once
            peers = D.all_gather_object((socket.gethostname(), os.getpid()))
            L.watch_peers(D.get_rank(), {r: pid for r, (h, pid) in enumerate(peers)
                                         if h == socket.gethostname() and r != D.get_rank()})
        D.setup_rank_logging()  # "[rank R]" on polyrl log lines; below WARNING only rank 0 speaks
        trainer = Trainer(cfg, backend)  # last place bad input can surface: nothing written yet
        out = Path(D.broadcast_object(str(_output(args))))
        lock = lock_run_dir(out, delegated_by=L.launcher_pid() if worker else None)
        run_dir = RunDir(out, is_main=D.is_main_process())
        if D.is_main_process() and (missing := events_missing()):
            say(missing)  # the run goes on: metrics.jsonl is the record, events/ a view of it
        bar = (not args.no_progress and sys.stderr.isatty()) or os.environ.get("POLYRL_PROGRESS", "") == "1"
        last = trainer.train(run_dir, resume_from=args.resume_from, progress=cfg.trainer.progress_bar and bar, log=say)
        say(f"done: {out} (step {trainer.state.step}, reward/mean {last['reward/mean']:.3f})" if last
            else f"nothing to do: {out} is already at step {trainer.state.step}")
        rc = 0
    except RunFault as exc:  # seen by this rank (maybe by it alone): it speaks, and leaves without a barrier
        print(f"polyrl run: {f'[rank {D.get_rank()}] ' if D.is_distributed() else ''}error: {exc}", file=sys.stderr)
        rc, alone = 1, True
    except TrainingAborted as exc:  # decided on every rank alike
        say(f"error: {exc}")
        rc = 1
    except BadInputError as exc:  # the same on every rank (verification and the lock are collective)
        if not D.is_distributed():
            raise
        say(f"error: {exc}")  # once, from rank 0
        rc = 2
    except RunStopped as exc:
        P.exit_if_a_peer_ended_first()
        if P.says_the_stop_line():
            say(exc.message)
        rc = 128 + exc.signum
    except KeyboardInterrupt:  # stopped while starting (before the run directory was opened)
        P.exit_if_a_peer_ended_first()
        signum = L.stop_signal() or 2
        if P.says_the_stop_line():
            ckpts = Path(args.output) / "checkpoints" if args.output else None  # else a new directory anyway
            print(f"polyrl run: {stopped_message(L.signal_name(signum), None, ckpts)}", file=sys.stderr)
        rc = 128 + signum
    except BaseException:
        P.exit_if_a_peer_is_gone()  # a collective broken by a dead peer: one line, not its traceback
        raise
    finally:
        if lock is not None:
            lock.release(undo=run_dir is None or not run_dir.opened)
        for undo in restore:
            undo()
    return P.end_process(rc, alone=alone)
