"""``--emulate``: run a backend's real code on the CPU against an emulator of its vendor library.

Only the ascend backend has one today: :func:`enable_emulation("ascend") <enable_emulation>` switches the backend
to CPU mode (``POLYRL_ASCEND_ON_CPU=1``: the host is its device), registers its collective library — gloo behind
HCCL's rules (polyrl.emulation.hccl: the dtypes and reduce ops HCCL refuses, with its error text; its int32 cast
and AVG; the all-to-all types of the release) — and places the packaged emulator of the documented torch_npu API (polyrl.emulation.npu) in ``sys.modules["torch_npu"]``.
Everything else — the attention route, the sink detection, the guards, the trainer — is the code that would run
on an NPU. An emulated run proves those code paths against the documented API; it says nothing about an NPU.

The emulated release can be chosen with environment variables (read here, inherited by ``--nproc`` workers):
``POLYRL_NPU_EMULATOR_VERSION`` (torch_npu, default 2.9.0), ``POLYRL_NPU_EMULATOR_CANN`` (default 8.5.0) and
``POLYRL_NPU_EMULATOR_SOC`` (default Ascend910B3). ``POLYRL_ASCEND_SINK=native|lse`` forces the sink route as on
hardware.

Used by ``polyrl run --emulate`` (and its torchrun workers, which receive the flag) and ``polyrl parity --emulate``.
"""

from __future__ import annotations

import os
import sys

from polyrl.core.errors import BadInputError

EMULATED_BACKENDS: tuple[str, ...] = ("ascend",)
VERSION_ENV = "POLYRL_NPU_EMULATOR_VERSION"
CANN_ENV = "POLYRL_NPU_EMULATOR_CANN"
SOC_ENV = "POLYRL_NPU_EMULATOR_SOC"


def enable_emulation(backend_name: str | None) -> None:
    """Make ``backend_name`` run on the CPU through its emulator, in this process (and in the processes it
    starts, through the environment). Idempotent. ``None`` reads ``POLYRL_BACKEND`` (as the selection does).
    Unknown or unsupported backend -> BadInputError."""
    backend_name = backend_name or os.environ.get("POLYRL_BACKEND") or None
    if backend_name not in EMULATED_BACKENDS:
        raise BadInputError(
            f"--emulate: backend {backend_name!r} has no emulator (emulated backends: {', '.join(EMULATED_BACKENDS)}); "
            "use --backend ascend --emulate"
        )
    from polyrl.backends.ascend import ON_CPU_ENV
    from polyrl.core.plugins.selection import reset_active_backend
    from polyrl.emulation import hccl
    from polyrl.emulation.npu import NpuEmulator

    os.environ[ON_CPU_ENV] = "1"
    hccl.register()
    current = sys.modules.get("torch_npu")
    if getattr(current, "__polyrl_emulator__", None) is None:
        if current is not None:
            raise BadInputError("--emulate: a real torch_npu is already imported in this process; "
                                "run without --emulate on an NPU machine")
        NpuEmulator(
            os.environ.get(VERSION_ENV, "2.9.0"),
            cann_version=os.environ.get(CANN_ENV, "8.5.0"),
            soc_version=os.environ.get(SOC_ENV, "Ascend910B3"),
        ).install()
    reset_active_backend()  # chosen again with the backend in CPU mode
