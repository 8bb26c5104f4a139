"""The backends present on this machine, as parity sees them: cpu always, ascend through its emulator (on the
CPU: it proves the backend's code paths against the documented torch_npu API, not an NPU), cuda only where a
GPU is (marked gpu: skipped elsewhere, never reported as passed)."""

from __future__ import annotations

import os
import sys

import pytest

from polyrl.core.plugins import list_backends
from polyrl.core.plugins.selection import reset_active_backend


@pytest.fixture
def backend_under_test(request):
    """(backend, emulated) for the param; the emulator and its environment are removed afterwards."""
    name = request.param
    if name != "ascend-emulated":
        yield list_backends()[name], False
        return
    from polyrl.emulation import enable_emulation

    saved_env = dict(os.environ)
    saved_npu = sys.modules.get("torch_npu")
    enable_emulation("ascend")
    try:
        yield list_backends()["ascend"], True
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
            del sys.modules[name]  # the emulator's submodules too (torch_npu.npu.utils), not only the top
        if saved_npu is not None:
            sys.modules["torch_npu"] = saved_npu
        reset_active_backend()
