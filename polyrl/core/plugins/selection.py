"""Which backend runs: the selection rule.

1. An explicit name (``--backend`` or ``backend.name``) or ``POLYRL_BACKEND`` wins (it must be available).
2. Otherwise the one available *accelerator* (``Backend.is_accelerator``: cuda, ascend, a ROCm plugin...).
3. Otherwise the reference backend (cpu).
Two or more available accelerators without an explicit choice is an error naming them. A backend that is not an
accelerator (the reference, a third-party CPU backend) is never picked implicitly: installing a CPU plugin does
not change what a plain ``polyrl run`` uses.

A run resolves its backend once (``resolve_backend``, the CLI) and binds it where its models are built; nothing on
its path reads a process-wide backend. ``default_backend()`` answers only a call that names none (a script's
``varlen_attention(q, k, v, cu)``, a model built without a backend): the rule's choice, resolved once per process.
"""

from __future__ import annotations

import os

from polyrl.core.errors import BackendSelectionError
from polyrl.core.plugins.backend import Backend
from polyrl.core.plugins.registry import get_registry

_active: Backend | None = None


def resolve_backend(name: str | None = None) -> Backend:
    """The backend called ``name``, or the one the selection rule picks. Does not touch a device."""
    registry = get_registry()
    backends = registry.backends
    name = name or os.environ.get("POLYRL_BACKEND") or None
    if name is not None:
        if name in backends:
            backend = backends[name]
            avail = backend.availability()
            if not avail.available:
                raise BackendSelectionError(f"backend {name!r} is not available: {avail.reason}")
            return backend
        if name in registry.not_loaded:
            raise BackendSelectionError(f"backend {name!r} is installed but not loaded: "
                                        f"{registry.not_loaded[name].reason}")
        raise BackendSelectionError(
            f"unknown backend {name!r}; installed backends: {', '.join(sorted(backends)) or '(none)'}"
        )
    candidates = [b for b in backends.values() if b.is_accelerator and b.availability().available]
    if len(candidates) > 1:
        names = ", ".join(sorted(b.name for b in candidates))
        raise BackendSelectionError(
            f"several accelerator backends are available ({names}); choose one with --backend or POLYRL_BACKEND"
        )
    if candidates:
        return candidates[0]
    reference = [b for b in backends.values() if b.is_reference]
    if not reference:
        raise BackendSelectionError("no accelerator available and no reference backend installed")
    return reference[0]


def default_backend() -> Backend:
    """The backend of a call that names none: the selection rule's choice (or what ``set_active_backend`` pinned,
    for a script or a test), resolved on the first such call and kept for the process."""
    global _active
    if _active is None:
        _active = resolve_backend()
    return _active


# The 0.2 name (the CLI no longer sets it: a run passes its backend).
get_active_backend = default_backend


def backend_for(spec: Backend | str | None) -> Backend:
    """A Backend from what an API accepts: None (``default_backend()``), a name, or a Backend itself."""
    if spec is None:
        return default_backend()
    if isinstance(spec, str):
        return resolve_backend(spec)
    return spec


def set_active_backend(name: str | None) -> Backend:
    """Pin ``default_backend()`` to the backend ``name`` (resolved by the rule); returns it."""
    global _active
    _active = resolve_backend(name)
    return _active


def reset_active_backend() -> None:
    global _active
    _active = None


def reset_registry() -> None:
    """Forget the loaded plugins and the active backend (tests that install or allow plugins)."""
    get_registry.cache_clear()
    reset_active_backend()
