"""The Backend: what a hardware plugin declares and implements — a small core (polyrl.core.plugins.protocol:
identity, detection, devices, kernels) and four named parts composed into it, each a small class of its own:

==================  ===============================================  =========================================
``placement``       generators, device memory, the sharding policy   polyrl.core.plugins.placement.Placement
``collectives``     process-group set-up, the expert all-to-all      polyrl.core.plugins.collectives.Collectives
``engines``         rollout engines' readiness and settings          polyrl.core.plugins.engines.EngineOptions
``introspection``   kernels provided, capabilities, doctor rows      polyrl.core.plugins.introspection.Introspection
==================  ===============================================  =========================================

A backend changes a part by subclassing it and naming the subclass on the class (``placement_part =
RocmPlacement``). The 0.2 surface keeps working: every part method is also a ``Backend`` method under the same
name (``backend.sharding_policy()`` forwards to ``backend.placement``), and a Backend subclass that overrides one
(``def sharding_policy(self)``, as 0.2 plugins do) is what the part answers with (polyrl.core.plugins.part).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

from polyrl.core.plugins.collectives import Collectives
from polyrl.core.plugins.engines import EngineOptions
from polyrl.core.plugins.introspection import CAPABILITIES, CAPABILITY_PREFIXES, Introspection, unknown_capabilities
from polyrl.core.plugins.kernels import (
    KERNEL_SLOTS,
    KERNELS,
    REFERENCE_KERNELS,
    one_line,
    resolve_kernel,
    static_kernel_problem,
)
from polyrl.core.plugins.part import FORWARDS, BackendPart
from polyrl.core.plugins.placement import Placement, ShardingPolicy
from polyrl.core.plugins.protocol import Availability, BackendCore


class Backend(BackendCore):
    """Base class of every backend: set the class attributes, implement ``detect``, and override what you provide
    (core methods here, the rest in a part)."""

    placement_part: ClassVar[type[Placement]] = Placement
    collectives_part: ClassVar[type[Collectives]] = Collectives
    engines_part: ClassVar[type[EngineOptions]] = EngineOptions
    introspection_part: ClassVar[type[Introspection]] = Introspection

    # Each part is built once per backend object, on first use (a backend stays cheap to construct).
    @functools.cached_property
    def placement(self) -> Placement:
        return self.placement_part(self)

    @functools.cached_property
    def collectives(self) -> Collectives:
        return self.collectives_part(self)

    @functools.cached_property
    def engines(self) -> EngineOptions:
        return self.engines_part(self)

    @functools.cached_property
    def introspection(self) -> Introspection:
        return self.introspection_part(self)

    @property
    def native_kernels(self) -> frozenset[str]:
        """Deprecated alias of ``provided_kernels()`` (0.1), kept until polyrl 0.4.0 for plugins that read it."""
        warnings.warn("Backend.native_kernels is deprecated and will be removed in polyrl 0.4.0; call "
                      "Backend.provided_kernels()", DeprecationWarning, stacklevel=2)
        return self.introspection.provided_kernels()


def _forwarding(part: str, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``Backend.<name>``: the part's own implementation (the class's, so that an override on a Backend subclass
    calling ``super().<name>()`` reaches the default, not itself)."""

    @functools.wraps(method)
    def forward(self: Backend, *args: Any, **kwargs: Any) -> Any:
        target = getattr(self, part)
        return getattr(type(target), name)(target, *args, **kwargs)

    forward.__doc__ = f"``backend.{part}.{name}``. {method.__doc__ or ''}".strip()
    setattr(forward, FORWARDS, True)
    return forward


# The 0.2 surface: each part method, also a Backend method (see the module docstring).
PARTS: dict[str, type[BackendPart]] = {"placement": Placement, "collectives": Collectives, "engines": EngineOptions,
                                       "introspection": Introspection}
for _part, _cls in PARTS.items():
    for _name in _cls.methods:
        setattr(Backend, _name, _forwarding(_part, _name, getattr(_cls, _name)))
del _part, _cls, _name

__all__ = [
    "CAPABILITIES",
    "CAPABILITY_PREFIXES",
    "KERNELS",
    "KERNEL_SLOTS",
    "PARTS",
    "REFERENCE_KERNELS",
    "Availability",
    "Backend",
    "BackendCore",
    "BackendPart",
    "Collectives",
    "EngineOptions",
    "Introspection",
    "Placement",
    "ShardingPolicy",
    "one_line",
    "resolve_kernel",
    "static_kernel_problem",
    "unknown_capabilities",
]
