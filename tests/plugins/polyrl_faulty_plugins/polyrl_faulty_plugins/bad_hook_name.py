"""A plugin whose hook name is misspelt (singular): pluggy finds no such hook."""

from polyrl.plugins import hookimpl


@hookimpl
def polyrl_register_backend(register):
    raise AssertionError("never called")
