"""The plugin layer: the Backend interface, the hook specifications, the entry-point registry and the rule
that picks the backend of a run.

- :mod:`.backend` — ``Backend`` (what a hardware plugin declares and implements), ``Availability``,
  ``ShardingPolicy``.
- :mod:`.hookspecs` — the pluggy hooks (``polyrl_register_*``) and the ``hookimpl`` marker plugins use.
- :mod:`.registry` — discovery through the ``polyrl.backends`` entry-point group.
- :mod:`.selection` — which backend runs (explicit name, else the one available accelerator, else cpu).

Imports go one way: backend, hookspecs <- registry <- selection.
"""

from polyrl.core.plugins.backend import Availability, Backend, ShardingPolicy
from polyrl.core.plugins.hookspecs import hookimpl, hookspec
from polyrl.core.plugins.registry import ENTRY_POINT_GROUP, PluginRegistry, get_registry, list_backends
from polyrl.core.plugins.selection import (
    get_active_backend,
    reset_active_backend,
    reset_registry,
    resolve_backend,
    set_active_backend,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Availability",
    "Backend",
    "PluginRegistry",
    "ShardingPolicy",
    "get_active_backend",
    "get_registry",
    "hookimpl",
    "hookspec",
    "list_backends",
    "reset_active_backend",
    "reset_registry",
    "resolve_backend",
    "set_active_backend",
]
