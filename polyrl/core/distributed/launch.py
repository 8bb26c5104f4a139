"""``polyrl run --nproc N``: re-run the same command as N local torchrun workers.

The launcher process does no training: it execs ``python -m torch.distributed.run --standalone
--nproc-per-node N -m polyrl <argv without --nproc>`` and returns torchrun's exit code. Each worker sees
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...), which is how ``polyrl run`` knows it is a
worker and must not launch again (``polyrl.core.distributed.under_torchrun``). Multi-node runs skip this
launcher and call torchrun with its own rendezvous directly (docs/distributed.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

from polyrl.core.errors import BadInputError


def strip_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N`` (the workers must not see it)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        out.append(arg)
    return out


def torchrun_command(argv: Sequence[str], nproc: int, *, master_port: int | None = None) -> list[str]:
    """The command line that starts ``nproc`` local workers running ``polyrl <argv>``.

    ``--standalone`` lets torchrun pick a free port and run its own rendezvous on localhost; a fixed
    ``master_port`` uses the static rendezvous on that port instead.
    """
    if nproc < 1:
        raise BadInputError(f"--nproc must be >= 1, got {nproc}")
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if master_port is None:
        cmd.append("--standalone")
    else:
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(master_port), "--nnodes", "1"]
    cmd += ["--nproc-per-node", str(nproc), "-m", "polyrl", *strip_nproc(argv)]
    return cmd


def launch_torchrun(
    argv: Sequence[str], nproc: int, *, env: Mapping[str, str] | None = None, master_port: int | None = None
) -> int:
    """Run ``polyrl <argv>`` as ``nproc`` torchrun workers; block until they end; return the exit code.

    One thread per worker for the CPU math libraries unless the user chose (``OMP_NUM_THREADS``):
    N workers with a thread per core each would oversubscribe the machine.
    """
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # Workers must import this same polyrl even when it is not installed (run from a checkout).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, child_env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(torchrun_command(argv, nproc, master_port=master_port), env=child_env, check=False)
    return proc.returncode
