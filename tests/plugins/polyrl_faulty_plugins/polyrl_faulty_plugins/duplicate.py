"""A plugin registering a rollout engine under polyrl's own name, ``hf``."""

from polyrl.plugins import hookimpl


@hookimpl
def polyrl_register_rollout_engines(register):
    register("hf", lambda model, **kwargs: None)
