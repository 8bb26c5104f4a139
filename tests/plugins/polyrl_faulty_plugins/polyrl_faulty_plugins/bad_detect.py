"""An accelerator backend whose detect() raises."""

from polyrl.plugins import Backend, hookimpl


class BadDetect(Backend):
    name = "bad_detect"
    device_type = "cpu"
    is_accelerator = True

    def detect(self):
        raise RuntimeError("planted detect failure\nsecond line of the message")


@hookimpl
def polyrl_register_backends(register):
    register(BadDetect)
