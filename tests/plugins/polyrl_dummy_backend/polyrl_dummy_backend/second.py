"""A second dummy backend in the same distribution, for the "two available candidates" rule."""

from polyrl.plugins import hookimpl
from polyrl_dummy_backend import DummyBackend


class Dummy2Backend(DummyBackend):
    name = "dummy2"


@hookimpl
def polyrl_register_backends(register):
    register(Dummy2Backend)
