"""A dummy out-of-tree backend with a real attention kernel (attention.py: pure torch, chunks of 32 queries).

Available only when POLYRL_DUMMY_AVAILABLE=1 (so tests can exercise selection). tests/test_conformance.py
runs the conformance kit on it in fp32 and bf16, and plants bugs in its kernel that the kit must catch.
"""

import os

from polyrl.core.plugins.backend import Availability, Backend
from polyrl.core.plugins.hookspecs import hookimpl


class DummyBackend(Backend):
    name = "dummy"
    device_type = "cpu"
    collective_backend = "gloo"
    capabilities = frozenset({"fp32"})
    # TODO(phase 2): native_kernels should say {"varlen_attention"} (or be derived from attention_kernel);
    # today it does not route anything and tests/test_plugins.py expects the fallback list unchanged.
    native_kernels = frozenset()
    attention_kernel = "polyrl_dummy_backend.attention:chunked_varlen_attention"

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
