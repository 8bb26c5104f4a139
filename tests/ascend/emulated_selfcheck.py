"""``python -m emulated_selfcheck``: the ascend self-check (polyrl.backends.ascend.selfcheck) on the torch_npu emulator,
as ``polyrl doctor --selfcheck`` starts it — for tests/ascend/test_selfcheck.py (on the CPU, not an NPU)."""

import sys

from polyrl.emulation import enable_emulation

enable_emulation("ascend")

from polyrl.backends.ascend import selfcheck  # noqa: E402 (after the emulator is in place)

sys.exit(selfcheck.main())
