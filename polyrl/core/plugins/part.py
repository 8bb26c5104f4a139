"""A named part of a backend: a small class that holds one concern's defaults (placement, collectives, engine
options, introspection), built once per backend object and reached as ``backend.<part>``.

A plugin changes a part in one of two ways, and both keep working:

- subclass the part and name it on the backend class (``placement_part = RocmPlacement``): the 0.3 way, which
  keeps each concern in its own small class;
- override the part's method on the Backend subclass under its 0.2 name (``def sharding_policy(self)``): the part
  answers with that override, so core, which asks the part, sees it (``BackendPart.__getattribute__``).

A part reads the backend's declarations (``collective_backend``, ``rollout_engines``, ...) through ``self.backend``
and its core methods (``device``) there too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from polyrl.core.plugins.backend import Backend

# Set on the Backend methods that only forward to a part (``Backend.sharding_policy`` -> ``placement``): such a
# method is the default, anything else under that name is a plugin's override.
FORWARDS = "_polyrl_forwards_to_part"


class BackendPart:
    """Base of the parts. ``methods``: the part's public methods, each also a method of ``Backend`` under the same
    name (the 0.2 surface)."""

    methods: ClassVar[tuple[str, ...]] = ()

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def __getattribute__(self, name: str) -> Any:
        # A 0.2-style override on the Backend subclass (looked up at each call, as a method of the class would be)
        # is what the part answers with.
        if name in type(self).methods:
            backend = object.__getattribute__(self, "backend")
            if name in vars(backend):  # set on the object itself (a test's or a script's patch)
                return vars(backend)[name]
            on_backend = getattr(type(backend), name, None)
            if on_backend is not None and not getattr(on_backend, FORWARDS, False):
                return getattr(backend, name)
        return object.__getattribute__(self, name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of backend {self.backend.name!r}>"
