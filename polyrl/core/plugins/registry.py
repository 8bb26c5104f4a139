"""Plugin discovery: the ``polyrl.backends`` entry-point group, loaded through pluggy.

polyrl's own backends (cpu, cuda, ascend) are entry points of the ``polyrl`` distribution and always load.
Third-party entry points load unless ``POLYRL_DISABLE_PLUGIN_AUTOLOAD=1``; ``POLYRL_LOAD_PLUGINS=a,b`` is
an allow-list of entry-point names: when set, only the listed third-party plugins load (even with
autoload disabled, as pytest's ``-p`` does). The test suite disables autoload (tests/conftest.py) so a
plugin installed on the developer's machine cannot change results; tests that need one turn it on.

Loading a plugin imports its module only; a backend's ``detect`` is what looks at hardware, and it never
initialises a device.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from importlib import metadata
from typing import Any

import pluggy

from polyrl.core.errors import BackendSelectionError
from polyrl.core.plugins import hookspecs
from polyrl.core.plugins.backend import Backend

ENTRY_POINT_GROUP = "polyrl.backends"
OWN_DISTRIBUTION = "polyrl"


@dataclasses.dataclass
class PluginRegistry:
    """What loaded plugins registered, plus the third-party plugins that were found but not loaded."""

    pm: pluggy.PluginManager
    backends: dict[str, Backend]
    tasks: dict[str, Any]
    rollout_engines: dict[str, Any]
    skipped: dict[str, str]  # entry-point name -> why it was not loaded


def _allow_list() -> set[str] | None:
    raw = os.environ.get("POLYRL_LOAD_PLUGINS")
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _autoload_disabled() -> bool:
    return os.environ.get("POLYRL_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0")


def _should_load(ep: metadata.EntryPoint) -> tuple[bool, str]:
    dist = ep.dist.name if ep.dist is not None else ""
    if dist == OWN_DISTRIBUTION:
        return True, ""
    allow = _allow_list()
    if allow is not None:
        if ep.name in allow:
            return True, ""
        return False, f"not in POLYRL_LOAD_PLUGINS={','.join(sorted(allow)) or '(empty)'}"
    if _autoload_disabled():
        return False, "third-party plugin autoload is disabled (POLYRL_DISABLE_PLUGIN_AUTOLOAD=1)"
    return True, ""


def _load_registry() -> PluginRegistry:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    skipped: dict[str, str] = {}
    versions: dict[str, tuple[str, str]] = {}
    # Sorted so that the order of registration (and of listings) is stable across machines.
    eps = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.dist.name != OWN_DISTRIBUTION if e.dist else True, e.name))
    seen: set[str] = set()
    for ep in eps:
        if ep.name in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add(ep.name)
        ok, why = _should_load(ep)
        if not ok:
            skipped[ep.name] = why
            continue
        module = ep.load()
        pm.register(module, name=ep.name)
        if ep.dist is not None:
            versions[ep.name] = (ep.dist.name, ep.dist.version)
    pm.check_pending()

    backends: dict[str, Backend] = {}

    def register_backend(cls: type) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Backend)) or not cls.name:
            raise TypeError(f"polyrl_register_backends: {cls!r} is not a named Backend subclass")
        if cls.name in backends:
            raise BackendSelectionError(f"backend {cls.name!r} is registered twice")
        backend = cls()
        backends[cls.name] = backend

    # Each plugin registers under its entry point; record which distribution each backend came from.
    for plugin_name, plugin in pm.list_name_plugin():
        before = set(backends)
        hook = getattr(plugin, "polyrl_register_backends", None)
        if hook is not None:
            hook(register=register_backend)
        dist, version = versions.get(plugin_name or "", ("", ""))
        for name in set(backends) - before:
            backends[name].distribution = dist
            backends[name].version = version

    tasks: dict[str, Any] = {}
    engines: dict[str, Any] = {}
    pm.hook.polyrl_register_tasks(register=tasks.__setitem__)
    pm.hook.polyrl_register_rollout_engines(register=engines.__setitem__)
    return PluginRegistry(pm=pm, backends=backends, tasks=tasks, rollout_engines=engines, skipped=skipped)


@functools.lru_cache(maxsize=1)
def get_registry() -> PluginRegistry:
    """The process-wide registry, loaded on first use. ``reset_registry()`` forgets it (tests)."""
    return _load_registry()



def list_backends() -> dict[str, Backend]:
    return dict(get_registry().backends)
