"""pluggy hook specifications: the whole plugin surface of polyrl.

Hooks are keyword-only and receive a ``register`` callback, so a plugin can register any number of
things without returning lists. A plugin module exposes functions decorated with ``polyrl.hookimpl``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "polyrl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def polyrl_register_backends(register: Callable[[type], None]) -> None:
    """Register Backend subclasses: ``register(MyBackend)``."""


@hookspec
def polyrl_register_tasks(register: Callable[[str, Any], None]) -> None:
    """Register task factories for recipes: ``register("my_task", factory)``."""


@hookspec
def polyrl_register_rollout_engines(register: Callable[[str, Any], None]) -> None:
    """Register rollout engine factories: ``register("my_engine", factory)``."""
