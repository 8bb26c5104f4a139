"""pluggy hook specifications: the whole plugin surface of polyrl.

Hooks are keyword-only and receive a ``register`` callback, so a plugin can register any number of
things without returning lists. A plugin module exposes functions decorated with
``polyrl.core.plugins.hookimpl`` (this module's ``hookimpl`` marker), named after the hooks below. Any plugin
may implement any subset of the hooks, whichever entry-point group it came from (``polyrl.backends`` or
``polyrl.plugins``) or when registered in-process with ``polyrl.core.plugins.register_plugin``.

Each plugin's hooks run on their own: one that raises (or registers something invalid) is reported under
``not_loaded`` with the error's line, and what it registered is dropped; the other plugins are unaffected.
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
    """Register Backend subclasses: ``register(MyBackend)`` (the class; polyrl instantiates it with no
    arguments). A name already registered by another plugin is an error of this plugin."""


@hookspec
def polyrl_register_tasks(register: Callable[[str, Any], None]) -> None:
    """Register task factories for recipes: ``register("my_task", factory)``; ``factory(**data.task_params)``
    returns a ``polyrl.core.tasks.Task``. Built-in task names cannot be shadowed."""


@hookspec
def polyrl_register_rollout_engines(register: Callable[[str, Any], None]) -> None:
    """Register rollout engine factories: ``register("my_engine", factory)``; ``factory(model, *, pad_token_id,
    **kwargs)`` returns a ``polyrl.core.rollout.RolloutEngine`` and is what ``rollout.engine: my_engine`` builds.
    A name already registered (polyrl's own ``hf`` included) is an error of this plugin."""
