"""A dummy out-of-tree backend with a real attention kernel (attention.py: pure torch, chunks of 32 queries).

Available only when POLYRL_DUMMY_AVAILABLE=1 (so tests can exercise selection). It is a CPU backend, so not an
accelerator: selection never picks it implicitly, unless POLYRL_DUMMY_ACCELERATOR=1 (read at import) says it is
one (for the selection tests). Its attention kernel is native (``attention_kernel`` names its own function), its
log-prob kernel the reference (the slot is left at its default). tests/testing/test_conformance.py runs the conformance
kit on it in fp32 and bf16, and plants bugs in its kernel that the kit must catch.
"""

import os

from polyrl.plugins import Availability, Backend, hookimpl


class DummyBackend(Backend):
    name = "dummy"
    device_type = "cpu"
    collective_backend = "gloo"
    capabilities = frozenset({"fp32", "rollout:hf", "x-chunked-attention"})
    is_accelerator = os.environ.get("POLYRL_DUMMY_ACCELERATOR") == "1"
    attention_kernel = "polyrl_dummy_backend.attention:chunked_varlen_attention"

    def detect(self) -> Availability:
        if os.environ.get("POLYRL_DUMMY_AVAILABLE") == "1":
            return Availability(True)
        return Availability(False, "POLYRL_DUMMY_AVAILABLE is not 1")


@hookimpl
def polyrl_register_backends(register):
    register(DummyBackend)
