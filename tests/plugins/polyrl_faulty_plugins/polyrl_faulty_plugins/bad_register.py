"""A plugin that registers a backend, then raises in the same hook: what it registered is dropped."""

from polyrl.plugins import Availability, Backend, hookimpl


class HalfRegistered(Backend):
    name = "half_registered"

    def detect(self):
        return Availability(True)


@hookimpl
def polyrl_register_backends(register):
    register(HalfRegistered)
    raise RuntimeError("planted registration failure")
