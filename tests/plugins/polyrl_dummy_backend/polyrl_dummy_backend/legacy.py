"""A backend written against the 0.1 module paths (``polyrl.core.backend``, ``polyrl.core.hookspecs``), as a
plugin from before ``polyrl.plugins`` existed: it must still load in 0.2, with a DeprecationWarning naming
``polyrl.plugins``. Never available, so it takes no part in selection."""

from polyrl.core.backend import Availability, Backend
from polyrl.core.hookspecs import hookimpl


class LegacyBackend(Backend):
    name = "dummy_legacy"
    device_type = "cpu"
    collective_backend = "gloo"

    def detect(self) -> Availability:
        return Availability(False, "written against the 0.1 paths; loads, never runs")


@hookimpl
def polyrl_register_backends(register):
    register(LegacyBackend)
