"""An available accelerator backend whose attention_kernel has a typo, and a capability outside the vocabulary."""

from polyrl.plugins import Availability, Backend, hookimpl


def varlen_attention(q, k, v, cu_seqlens, *, scale, window, sinks):
    raise AssertionError("never called: the path below misspells this function")


class BadKernel(Backend):
    name = "bad_kernel"
    device_type = "cpu"
    is_accelerator = True
    capabilities = frozenset({"fp32", "warp-drive"})
    attention_kernel = "polyrl_faulty_plugins.bad_kernel:varlen_attenton"

    def detect(self):
        return Availability(True)


@hookimpl
def polyrl_register_backends(register):
    register(BadKernel)
