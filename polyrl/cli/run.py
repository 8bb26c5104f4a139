"""``polyrl run RECIPE [--backend NAME] [--output DIR] [--seed N] [--nproc N] [--resume-from step_N] [--dry-run] [--emulate] [key.path=value ...]``

``--dry-run [--nnodes M] [--json] [--device-memory GIB]`` validates and prints the memory plan instead
(:mod:`polyrl.cli.dry_run`).

Order matters for the exit-2 contract: the recipe is loaded and validated, the backend resolved, and the
trainer built (task, data file, models) before the run directory is created or touched; any bad input
raises ``BadInputError`` on the way and the CLI front prints one line and exits 2. Only then is the run
directory locked (one live run per directory: a directory held by a live run is bad input too, found
before anything there is written), opened (resuming from its last complete checkpoint when it has one)
and the loop started. Under ``--nproc`` the launcher holds the lock and its workers die with it
(``polyrl.core.distributed.launch``); SIGINT/SIGTERM/SIGHUP stop every process where it is (exit 128+N).

Module-level imports stay light: ``polyrl backends`` imports this module to build its parser.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Same command, same numbers on a loaded CPU: with OpenMP's dynamic teams (OMP_DYNAMIC=TRUE) libgomp sizes
# each parallel region by the load average, and torch's reductions split their work by team size, so the
# results would follow the machine's load. FALSE is libgomp's default; it is forced here because only
# this process and its torchrun workers read it, when torch loads (docs/distributed.md, "Determinism").
os.environ["OMP_DYNAMIC"] = "FALSE"

# Speed, not numbers: OpenMP threads that spin while waiting (libgomp's default) lose their time slices to
# each other when other processes share the cores; sleeping waiters measured ~10-30x faster per step on
# a loaded 2-core machine, but ~2x slower on an idle one (docs/distributed.md). So: passive only when
# other processes keep more than half the cores busy as the run starts, sampled over a moment (the 1-minute
# load average is no guide: it still counts the work that just ended, the previous run's included). The
# launcher decides for its workers (they would see each other starting). The user's choice wins.
_OMP_DECIDED_ENV = "POLYRL_OMP_WAIT_DECIDED"
BUSY_SAMPLE_S = 0.2


def _busy_cores(sample_s: float = BUSY_SAMPLE_S) -> float | None:
    """How many cores other processes keep busy now (this one sleeps while sampling): /proc/stat over
    ``sample_s``; the 1-minute load average where there is no /proc (None where neither exists)."""
    def totals() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle  # user..steal (guest time is already in user)

    first = totals()
    if first is None:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    import time

    time.sleep(sample_s)
    second = totals()
    total, idle = second[0] - first[0], second[1] - first[1]  # type: ignore[index]
    return (os.cpu_count() or 1) * (1.0 - idle / total) if total > 0 else 0.0


def _choose_omp_wait_policy() -> None:
    """Before torch loads (libgomp reads the policy once, then); a no-op when torch is already loaded,
    the user set the policy, or the launcher of this worker decided."""
    if "OMP_WAIT_POLICY" in os.environ or os.environ.get(_OMP_DECIDED_ENV) or "torch" in sys.modules:
        return
    os.environ[_OMP_DECIDED_ENV] = "1"
    busy = _busy_cores()
    if busy is not None and busy > 0.5 * (os.cpu_count() or 1):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


STOP_SIGNUMS = (2, 15, 1)  # SIGINT, SIGTERM, SIGHUP: the user's stop (one line says how to resume)


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=None, help="backend name (default: the selection rule)")
    p.add_argument("--output", default=None, help="run directory (default: runs/<recipe>-<time>); reused = resume")
    p.add_argument("--seed", type=int, default=None, help="seed of every random source (= trainer.seed=N)")
    p.add_argument("--nproc", type=int, default=1, help="local processes (torchrun, FSDP2)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of --nproc processes each (the --dry-run plan)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate, print the resolved config and the per-device memory plan; run nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: one JSON object {config, memory_plan}")
    p.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                   help="with --dry-run: memory of one device (default: the backend's table)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--resume-from", default=None, metavar="step_N",
                   help="resume from this checkpoint of --output (step_N, N, or its path) instead of the newest; "
                        "newer ones are set aside")
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


def _recipe_name(spec: str) -> str:
    return Path(spec).name.removesuffix(".yaml").removesuffix(".yml")


def main(args: argparse.Namespace) -> int:
    args = _split_remainder(args)
    if not args.dry_run:  # a dry run computes no tensors: no threads to tune, no sample to wait for
        _choose_omp_wait_policy()
    from polyrl.core import distributed as D
    from polyrl.core.config import dump_config, load_config
    from polyrl.core.plugins.selection import set_active_backend

    if args.emulate:
        from polyrl.emulation import enable_emulation

        enable_emulation(args.backend)
    overrides = list(args.overrides)
    if args.seed is not None:
        overrides.append(f"trainer.seed={args.seed}")
    if args.backend is not None:
        overrides.append(f"backend.name={args.backend}")
    cfg = load_config(args.recipe, overrides)
    if not args.dry_run and (args.nnodes != 1 or args.json or args.device_memory is not None):
        from polyrl.core.errors import BadInputError

        raise BadInputError("--nnodes, --json and --device-memory go with --dry-run (a multi-node run is started "
                            "by `torchrun --nnodes M --nproc-per-node N ... -m polyrl run` on each node)")
    if args.dry_run:
        from polyrl.cli.dry_run import dry_run

        return dry_run(cfg, nproc=args.nproc, nnodes=args.nnodes, as_json=args.json, device_memory_gib=args.device_memory)
    backend = set_active_backend(cfg.backend.name)
    if cfg.backend.name is None:
        cfg.backend.name = backend.name  # the resolved config names what actually ran
    config_yaml = dump_config(cfg)
    if args.nproc > 1 and not D.under_torchrun():
        return _launch(args, cfg, backend)
    return _train(args, cfg, backend, config_yaml)


def _launch(args: argparse.Namespace, cfg, backend) -> int:
    """Validate here, in the launcher, what can be validated without a process group (so bad input
    still exits 2 with one line), lock the run directory, then re-run this command as ``--nproc`` torchrun
    workers. The launcher holds the directory's lock until the last worker has ended; rank 0 recognises
    its launcher as the holder (``RunLock.acquire(delegated_by=...)``)."""
    from polyrl.core.distributed.launch import launch_torchrun
    from polyrl.core.distributed.sharding import check_sharding
    from polyrl.core.errors import BadInputError
    from polyrl.core.run.directory import RunLock, check_unlocked, default_run_dir
    from polyrl.core.trainer.setup import build_task, check_config

    out = Path(args.output) if args.output else default_run_dir(_recipe_name(args.recipe))
    check_unlocked(out)  # a live run there: refuse before the setup below
    check_config(cfg)
    build_task(cfg)
    check_sharding(backend, args.nproc, cfg.sharding)
    from polyrl.core.run.checkpoint import check_resume

    check_resume(out / "checkpoints", args.resume_from)  # a refused checkpoint: one line, before any worker
    if cfg.data.batch_size % args.nproc:
        raise BadInputError(
            f"data.batch_size ({cfg.data.batch_size}) must be a multiple of --nproc ({args.nproc}): "
            "each process takes an equal share of the prompts"
        )
    argv = ["run", args.recipe, *args.overrides, "--output", str(out)]  # every rank writes the same directory
    for flag, value in (("--backend", args.backend), ("--seed", args.seed), ("--resume-from", args.resume_from)):
        if value is not None:
            argv += [flag, str(value)]
    if args.no_progress:
        argv.append("--no-progress")
    if args.emulate:
        argv.append("--emulate")
    lock = RunLock.acquire(out)
    code = 1
    try:
        code = launch_torchrun(argv, args.nproc)
    finally:
        lock.release(undo=code == 2)  # bad input seen by a worker: nothing was written, leave no trace
    if code - 128 in STOP_SIGNUMS:
        # The stop line comes from here, not from rank 0: the launcher is the one process certain to be alive
        # and past every worker's end, whatever moment the signal found the workers in (a worker still
        # starting its interpreter dies of it without a word). The step is the last one logged.
        print(f"polyrl run: {_stopped_message(code - 128, _last_logged_step(out), out / 'checkpoints')}",
              file=sys.stderr)
    elif code not in (0, 2):  # a worker failed (rank 0 may be the one gone)
        from polyrl.core.run.checkpoint import latest_checkpoint

        found = latest_checkpoint(out / "checkpoints")
        resume = f"resumes from {found.name}" if found else "starts over (no complete checkpoint yet)"
        print(f"polyrl run: the same command {resume}", file=sys.stderr)
    return code


def _stopped_message(signum: int, step: int | str | None, checkpoints: Path | None) -> str:
    """``stopped by SIGTERM at step 7; the same command resumes from step 6`` (step None: while starting)."""
    from polyrl.core.distributed import launch as L
    from polyrl.core.run.checkpoint import latest_checkpoint

    found = latest_checkpoint(checkpoints) if checkpoints is not None else None
    resume = f"resumes from step {int(found.name.split('_')[1])}" if found else "starts over (no checkpoint yet)"
    where = "while starting" if step is None else f"at step {step}"
    return f"stopped by {L.signal_name(signum)} {where}; the same command {resume}"


def _last_logged_step(out: Path) -> int | str:
    """The last step in the run's metrics.jsonl (0 when there is none yet); "?" when it cannot be read."""
    from polyrl.core.errors import BadInputError
    from polyrl.core.run.report import read_metrics

    if not (out / "metrics.jsonl").is_file():
        return 0
    try:
        records, _ = read_metrics(out)
    except BadInputError:
        return "?"
    return int(records[-1]["step"]) if records else 0


def _says_the_stop_line() -> bool:
    """Who prints "stopped by ...": the only process, or rank 0 of a torchrun started by hand; under the
    `polyrl run --nproc` launcher the launcher does."""
    from polyrl.core.distributed import launch as L

    return os.environ.get("RANK", "0") == "0" and L.launcher_pid() is None


def _train(args: argparse.Namespace, cfg, backend, config_yaml: str) -> int:
    """One process of the run (the only one, or a torchrun worker): lifeline, signals, lock, resume, fit."""
    from polyrl.core import distributed as D
    from polyrl.core.distributed import launch as L

    if D.under_torchrun():
        L.worker_lifeline()  # die with torchrun's agent and with the `polyrl run --nproc` launcher
    restore_handlers = L.install_stop_handlers()  # SIGINT/SIGTERM/SIGHUP: stop where we are
    restore_determinism = _pin_determinism(backend)
    try:
        try:
            rc = _train_in_dir(args, cfg, backend, config_yaml)
        except KeyboardInterrupt:  # stopped while starting (before the run directory was opened)
            signum = L.stop_signal() or 2
            if _says_the_stop_line():
                ckpts = Path(args.output) / "checkpoints" if args.output else None  # else a new directory anyway
                print(f"polyrl run: {_stopped_message(signum, None, ckpts)}", file=sys.stderr)
            rc = 128 + signum
        if rc in (0, 1, 2):  # finished, aborted (TrainingAborted) or refused (every rank past the barrier):
            D.barrier()  # every rank's work is done: a peer that leaves from here on is no failure
            L.unwatch_peers()
            D.shutdown_distributed()  # leave the process group cleanly. A stopped run may have peers gone
        elif rc > 128 and D.under_torchrun():
            # A stopped worker: its files are closed and its lock released; exit without the interpreter's
            # teardown, which would destroy a process group whose peers are gone (C++ threads still joinable:
            # "terminate called without an active exception", SIGABRT).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        return rc
    finally:
        restore_determinism()
        restore_handlers()


def _train_in_dir(args: argparse.Namespace, cfg, backend, config_yaml: str) -> int:
    from polyrl.core import distributed as D
    from polyrl.core.distributed import launch as L
    from polyrl.core.errors import BadInputError
    from polyrl.core.run.checkpoint import load_latest_checkpoint
    from polyrl.core.run.directory import RunDir, RunDirLocked, RunLock, check_unlocked, default_run_dir
    from polyrl.core.trainer import Trainer, TrainingAborted, fit

    worker = D.under_torchrun()
    if args.output and not worker:
        check_unlocked(args.output)  # a live run there: refuse before building anything
    D.init_distributed(backend)
    if D.is_distributed():  # a peer worker of this host that ends mid-run ends this one at once
        import socket

        host = socket.gethostname()
        peers = D.all_gather_object((host, os.getpid()))
        L.watch_peers(D.get_rank(), {r: pid for r, (h, pid) in enumerate(peers) if h == host and r != D.get_rank()})
    D.setup_rank_logging()  # "[rank R]" on polyrl log lines; below WARNING only rank 0 speaks
    trainer = Trainer(cfg, backend)  # last place bad input can surface: nothing written yet
    out = Path(args.output) if args.output else default_run_dir(_recipe_name(args.recipe))
    out = Path(D.broadcast_object(str(out)))
    # The lock, before the directory is read or written: rank 0 takes it (or finds its launcher holding it)
    # and every rank learns the outcome, so a refused run ends all ranks, not just rank 0.
    lock, refused = None, None
    if D.is_main_process():
        try:
            lock = RunLock.acquire(out, delegated_by=L.launcher_pid() if worker else None)
        except RunDirLocked as exc:
            refused = exc
    reason = D.broadcast_object(str(refused) if refused is not None else None)
    if reason is not None:
        if not D.is_distributed():
            raise refused  # type: ignore[misc]
        if D.is_main_process():  # say why once, before any rank exits (torchrun stops the others then)
            print(f"polyrl run: error: {reason}", file=sys.stderr, flush=True)
        D.barrier()
        return 2
    say = (lambda msg: print(f"polyrl run: {msg}", file=sys.stderr)) if D.is_main_process() else (lambda msg: None)
    run_dir = RunDir(out, is_main=D.is_main_process())
    wrote = False
    try:
        # Collective on every rank, unconditionally: rank 0 decides (a missing directory means a fresh run)
        # and broadcasts; a per-rank is_dir() test races with rank 0 creating the directory and deadlocks.
        resumed = load_latest_checkpoint(run_dir.checkpoints, trainer.checkpoint_state(), backend=backend,
                                         resume_from=args.resume_from)  # verified first; refusal = exit 2
        say(f"backend {backend.origin()}")  # the run log's first line (after bad input could still surface)
        wrote = True
        run_dir.open(config_yaml, resume_step=resumed)
        from polyrl.core.run.export import save_model_metadata

        save_model_metadata(run_dir.checkpoints, trainer.models.actor, trainer.tokenizer)  # for `polyrl export`
        if resumed is not None:
            say(f"resuming {out} from step {resumed}")
        try:
            bar = cfg.trainer.progress_bar and ((not args.no_progress and sys.stderr.isatty()) or _force_bar())
            last = fit(trainer, run_dir, progress=bar, log=say)
        finally:
            run_dir.close()
    except TrainingAborted as exc:
        say(f"error: {exc}")
        return 1
    except BadInputError as exc:  # e.g. a refused checkpoint: the same on every rank (verification is collective)
        if not D.is_distributed():
            raise
        say(f"error: {exc}")  # once, from rank 0
        return 2
    except BaseException as exc:
        signum = L.stop_signal()
        if signum is None and not isinstance(exc, KeyboardInterrupt):
            _exit_if_a_peer_is_gone()  # a collective broken by a dead peer: one line, not its traceback
            raise
        # Stopped by a signal (or, on another rank, by a collective broken by a stopping peer). A checkpoint
        # being written was abandoned: only complete ones are ever loaded.
        signum = signum if signum is not None else 2  # a KeyboardInterrupt raised by Python's own handler
        if _says_the_stop_line():
            say(_stopped_message(signum, trainer.state.step, run_dir.checkpoints))
        return 128 + signum
    finally:
        if lock is not None:
            lock.release(undo=not wrote)
    if last:
        say(f"done: {out} (step {trainer.state.step}, reward/mean {last['reward/mean']:.3f})")
    else:
        say(f"nothing to do: {out} is already at step {trainer.state.step}")
    return 0


def _exit_if_a_peer_is_gone(wait_s: float = 1.0) -> None:
    """A collective can fail a moment before the dead peer's process is reaped: look for ``wait_s``."""
    import time

    from polyrl.core import distributed as D
    from polyrl.core.distributed import launch as L

    deadline = time.monotonic() + (wait_s if D.is_distributed() else 0.0)
    while True:
        gone = L.peer_gone()
        if gone is not None:
            L.stop_for_peer(D.get_rank(), *gone)
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def _pin_determinism(backend):
    """Same command, same metrics on the reference (CPU) backend, even on a loaded machine: deterministic
    algorithms (torch's CPU ``index_put_(accumulate=True)`` otherwise adds floats with racing atomics
    across threads, e.g. in the backward of the MoE expert-bias gather). Returns a function that restores
    the previous setting (``polyrl run`` may be called in-process, e.g. by tests)."""
    import torch

    if not backend.is_reference:
        return lambda: None
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    return lambda: torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _force_bar() -> bool:
    return os.environ.get("POLYRL_PROGRESS", "") == "1"
