"""Plugin discovery: the ``polyrl.backends`` and ``polyrl.plugins`` entry-point groups, loaded through pluggy.

Both groups load the same way and a plugin module in either may implement any hook; ``polyrl.backends`` is the
group of hardware backends (polyrl's own cpu, cuda and ascend are entry points of the ``polyrl`` distribution
there and always load), ``polyrl.plugins`` the natural home of a plugin that only adds tasks or rollout engines.
Third-party entry points load unless ``POLYRL_DISABLE_PLUGIN_AUTOLOAD=1``; ``POLYRL_LOAD_PLUGINS=a,b`` is an
allow-list of entry-point names: when set, only the listed third-party plugins load (even with autoload
disabled, as pytest's ``-p`` does). The test suite disables autoload (tests/conftest.py) so a plugin installed
on the developer's machine cannot change results; tests that need one turn it on. Plugins registered in-process
(``register_plugin``) always load, after the entry points.

Isolation: a plugin whose import raises, whose hooks raise or register something invalid (not a Backend, a name
another plugin already took), is not loaded — it is listed in ``not_loaded`` with its entry-point name, its
distribution and the error's one line, what it registered is dropped, and every other plugin loads as usual.

Loading a plugin imports its module only; a backend's ``detect`` is what looks at hardware, and it never
initialises a device.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from importlib import metadata
from typing import Any

import pluggy

from polyrl.core.plugins import hookspecs
from polyrl.core.plugins.backend import Backend
from polyrl.core.plugins.kernels import one_line

ENTRY_POINT_GROUP = "polyrl.backends"
ENTRY_POINT_GROUPS: tuple[str, ...] = (ENTRY_POINT_GROUP, "polyrl.plugins")
OWN_DISTRIBUTION = "polyrl"
HOOKS: tuple[str, ...] = ("polyrl_register_backends", "polyrl_register_tasks", "polyrl_register_rollout_engines")

# name -> plugin object registered in-process (register_plugin in polyrl.core.plugins).
_in_process: dict[str, Any] = {}


@dataclasses.dataclass(frozen=True)
class NotLoaded:
    """A plugin that was found but not loaded: by a loading rule (``failed`` False) or because it failed."""

    name: str  # the entry-point name
    distribution: str
    reason: str  # one line
    failed: bool = False

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PluginRegistry:
    """What loaded plugins registered, plus the plugins that were found but not loaded."""

    pm: pluggy.PluginManager
    backends: dict[str, Backend]
    tasks: dict[str, Any]
    rollout_engines: dict[str, Any]
    not_loaded: dict[str, NotLoaded]

    @property
    def skipped(self) -> dict[str, str]:
        """entry-point name -> why it was not loaded (rules and failures alike)."""
        return {n.name: n.reason for n in self.not_loaded.values()}

    @property
    def failed(self) -> list[NotLoaded]:
        return [n for n in self.not_loaded.values() if n.failed]


def _allow_list() -> set[str] | None:
    raw = os.environ.get("POLYRL_LOAD_PLUGINS")
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _autoload_disabled() -> bool:
    return os.environ.get("POLYRL_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0")


def _should_load(name: str, dist: str) -> tuple[bool, str]:
    if dist == OWN_DISTRIBUTION:
        return True, ""
    allow = _allow_list()
    if allow is not None:
        if name in allow:
            return True, ""
        return False, f"not in POLYRL_LOAD_PLUGINS={','.join(sorted(allow)) or '(empty)'}"
    if _autoload_disabled():
        return False, "third-party plugin autoload is disabled (POLYRL_DISABLE_PLUGIN_AUTOLOAD=1)"
    return True, ""


@dataclasses.dataclass
class _Candidate:
    name: str
    distribution: str
    version: str
    load: Callable[[], Any]
    in_process: bool = False  # registered by the program itself: always loads


def _candidates() -> tuple[list[_Candidate], dict[str, NotLoaded]]:
    """Entry points of every group (polyrl's own first, then by name), then the in-process plugins."""
    found: list[_Candidate] = []
    clashes: dict[str, NotLoaded] = {}
    eps = [ep for group in ENTRY_POINT_GROUPS for ep in metadata.entry_points(group=group)]

    def dist_of(ep: metadata.EntryPoint) -> tuple[str, str]:
        return (ep.dist.name, ep.dist.version) if ep.dist is not None else ("", "")

    eps.sort(key=lambda e: (dist_of(e)[0] != OWN_DISTRIBUTION, e.name, e.group))
    seen: dict[str, tuple[str, str]] = {}
    for ep in eps:
        dist, version = dist_of(ep)
        if ep.name in seen:
            if seen[ep.name] != (dist, ep.value):  # the same distribution twice on sys.path is not a clash
                clashes.setdefault(ep.name + f" ({dist})", NotLoaded(
                    ep.name, dist, f"entry-point name {ep.name!r} is already taken by {seen[ep.name][0] or '?'}",
                    failed=True))
            continue
        seen[ep.name] = (dist, ep.value)
        found.append(_Candidate(ep.name, dist, version, ep.load))
    for name, plugin in _in_process.items():
        found.append(_Candidate(name, "", "", lambda plugin=plugin: plugin, in_process=True))
    return found, clashes


def _run_hooks(pm: pluggy.PluginManager, plugin: Any, origin: tuple[str, str]) -> dict[str, dict[str, Any]]:
    """Call ``plugin``'s own hook implementations, collecting what it registers (raises on its errors)."""
    staged: dict[str, dict[str, Any]] = {hook: {} for hook in HOOKS}

    def register_backend(cls: type) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Backend)) or not cls.name:
            raise TypeError(f"polyrl_register_backends: {cls!r} is not a named Backend subclass")
        if cls.name in staged["polyrl_register_backends"]:
            raise ValueError(f"backend {cls.name!r} is registered twice")
        backend = cls()
        backend.distribution, backend.version = origin
        staged["polyrl_register_backends"][cls.name] = backend

    def named(hook: str) -> Callable[[str, Any], None]:
        def register(name: str, factory: Any) -> None:
            if not isinstance(name, str) or not name:
                raise TypeError(f"{hook}: the name must be a non-empty string, got {name!r}")
            if not callable(factory):
                raise TypeError(f"{hook}: the factory of {name!r} is not callable")
            staged[hook][name] = factory

        return register

    callbacks = {"polyrl_register_backends": register_backend, "polyrl_register_tasks": named("polyrl_register_tasks"),
                 "polyrl_register_rollout_engines": named("polyrl_register_rollout_engines")}
    for caller in pm.get_hookcallers(plugin) or []:
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin:
                impl.function(register=callbacks[caller.name])
    return staged


def _merge(staged: dict[str, dict[str, Any]], targets: dict[str, dict[str, Any]], owners: dict[tuple[str, str], str],
           plugin_name: str) -> None:
    """Add one plugin's registrations to the registry; a name another plugin took is this plugin's error."""
    what = {"polyrl_register_backends": "backend", "polyrl_register_tasks": "task",
            "polyrl_register_rollout_engines": "rollout engine"}
    for hook, items in staged.items():
        for name in items:
            if name in targets[hook]:
                raise ValueError(f"{what[hook]} {name!r} is already registered by plugin "
                                 f"{owners[(hook, name)]!r}")
    for hook, items in staged.items():
        targets[hook].update(items)
        owners.update({(hook, name): plugin_name for name in items})


def _load_registry() -> PluginRegistry:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    candidates, not_loaded = _candidates()
    targets: dict[str, dict[str, Any]] = {hook: {} for hook in HOOKS}
    owners: dict[tuple[str, str], str] = {}
    for cand in candidates:
        ok, why = (True, "") if cand.in_process else _should_load(cand.name, cand.distribution)
        if not ok:
            not_loaded[cand.name] = NotLoaded(cand.name, cand.distribution, why)
            continue
        step = "import"
        try:
            plugin = cand.load()
            step = "registration"
            pm.register(plugin, name=cand.name)
            try:
                pm.check_pending()  # a misspelt hook name in this plugin
                _merge(_run_hooks(pm, plugin, (cand.distribution, cand.version)), targets, owners, cand.name)
            except BaseException:
                pm.unregister(plugin)
                raise
        except Exception as exc:  # isolation: report the plugin, keep loading the others
            not_loaded[cand.name] = NotLoaded(cand.name, cand.distribution, f"{step} failed: {one_line(exc)}",
                                              failed=True)
    return PluginRegistry(pm=pm, backends=targets["polyrl_register_backends"],
                          tasks=targets["polyrl_register_tasks"],
                          rollout_engines=targets["polyrl_register_rollout_engines"], not_loaded=not_loaded)


@functools.lru_cache(maxsize=1)
def get_registry() -> PluginRegistry:
    """The process-wide registry, loaded on first use. ``reset_registry()`` forgets it (tests)."""
    return _load_registry()


def add_in_process(plugin: Any, name: str) -> None:
    if name in _in_process:
        raise ValueError(f"a plugin called {name!r} is already registered in-process")
    _in_process[name] = plugin
    get_registry.cache_clear()


def remove_in_process(name: str) -> None:
    _in_process.pop(name, None)
    get_registry.cache_clear()


def list_backends() -> dict[str, Backend]:
    return dict(get_registry().backends)
