"""A dummy out-of-tree backend. Available only when POLYRL_DUMMY_AVAILABLE=1 (so tests can exercise selection)."""

import os

from polyrl.core.backend import Availability, Backend
from polyrl.core.hookspecs import hookimpl


class DummyBackend(Backend):
    name = "dummy"
    device_type = "cpu"
    collective_backend = "gloo"
    capabilities = frozenset({"fp32"})
    native_kernels = frozenset()

    def detect(self) -> Availability:
        if os.environ.get("POLYRL_DUMMY_AVAILABLE") == "1":
            return Availability(True)
        return Availability(False, "POLYRL_DUMMY_AVAILABLE is not 1")


@hookimpl
def polyrl_register_backends(register):
    register(DummyBackend)


@hookimpl
def polyrl_register_tasks(register):
    register("dummy_task", lambda **params: ("dummy task", params))
