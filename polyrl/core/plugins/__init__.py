"""The plugin layer: the Backend interface, the hook specifications, the entry-point registry and the rule
that picks the backend of a run.

- :mod:`.backend` — ``Backend`` (what a hardware plugin declares and implements): the core of :mod:`.protocol`
  (identity, detection, devices, kernels: ``BackendCore``, ``Availability``) composed with its named parts,
  :mod:`.placement` (``Placement``, ``ShardingPolicy``), :mod:`.collectives` (``Collectives``, with the default
  expert exchange of :mod:`.expert_exchange`), :mod:`.engines` (``EngineOptions``) and :mod:`.introspection`
  (``Introspection``, the capability vocabulary); :mod:`.kernels` — the kernel slots and their paths.
- :mod:`.hookspecs` — the pluggy hooks (``polyrl_register_*``) and the ``hookimpl`` marker plugins use.
- :mod:`.registry` — discovery through the ``polyrl.backends`` / ``polyrl.plugins`` entry-point groups, each
  plugin isolated from the others.
- :mod:`.selection` — which backend runs (explicit name, else the one available accelerator, else cpu).

Imports go one way: kernels <- protocol, part <- the parts <- backend; backend, hookspecs <- registry <- selection. ``register_plugin`` adds a plugin without an
entry point (a script, a notebook, a test): its hooks run exactly as an installed plugin's do.
"""

from typing import Any

from polyrl.core.plugins.backend import (
    CAPABILITIES,
    KERNELS,
    Availability,
    Backend,
    BackendCore,
    BackendPart,
    Collectives,
    EngineOptions,
    Introspection,
    Placement,
    ShardingPolicy,
)
from polyrl.core.plugins.hookspecs import hookimpl, hookspec
from polyrl.core.plugins.kernels import AttentionLayout
from polyrl.core.plugins.registry import (
    ENTRY_POINT_GROUP,
    ENTRY_POINT_GROUPS,
    NotLoaded,
    PluginRegistry,
    get_registry,
    list_backends,
)
from polyrl.core.plugins.registry import add_in_process as _add_in_process
from polyrl.core.plugins.registry import remove_in_process as _remove_in_process
from polyrl.core.plugins.selection import (
    default_backend,
    get_active_backend,
    reset_active_backend,
    reset_registry,
    resolve_backend,
    set_active_backend,
)


def register_plugin(plugin: Any, name: str) -> None:
    """Register ``plugin`` (a module, class or object with ``@hookimpl`` functions) in this process, as if it
    were installed under the entry-point name ``name``; the registry reloads on next use."""
    _add_in_process(plugin, name)
    reset_active_backend()


def unregister_plugin(name: str) -> None:
    """Undo ``register_plugin``."""
    _remove_in_process(name)
    reset_active_backend()


__all__ = [
    "CAPABILITIES",
    "AttentionLayout",
    "ENTRY_POINT_GROUP",
    "ENTRY_POINT_GROUPS",
    "KERNELS",
    "Availability",
    "Backend",
    "BackendCore",
    "BackendPart",
    "Collectives",
    "EngineOptions",
    "Introspection",
    "NotLoaded",
    "Placement",
    "PluginRegistry",
    "ShardingPolicy",
    "default_backend",
    "get_active_backend",
    "get_registry",
    "hookimpl",
    "hookspec",
    "list_backends",
    "register_plugin",
    "reset_active_backend",
    "reset_registry",
    "resolve_backend",
    "set_active_backend",
    "unregister_plugin",
]
