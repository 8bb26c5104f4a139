"""A plugin whose hook name is misspelt (singular): pluggy finds no such hook."""

from polyrl.core.plugins import hookimpl


@hookimpl
def polyrl_register_backend(register):
    raise AssertionError("never called")
