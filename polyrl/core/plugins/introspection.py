"""The introspection part of a backend: what ``polyrl backends``, ``polyrl doctor`` and the conformance kit report
about it — its kernels provided and falling back, the capability vocabulary, its compatibility rows, its origin.

Reading a backend never imports a vendor module: kernel paths are checked from the source, compatibility rows
read metadata and files (polyrl.core.compat).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from polyrl.core.plugins.kernels import KERNELS, REFERENCE_KERNELS, one_line
from polyrl.core.plugins.part import BackendPart

if TYPE_CHECKING:
    from polyrl.core.compat import Compatibility

# The capability vocabulary (docs/plugins.md): what each name in ``Backend.capabilities`` promises. Names outside
# it are reported by ``polyrl backends`` as warnings and fail the conformance kit; a plugin's private flags use
# the "x-" prefix.
CAPABILITIES: dict[str, str] = {
    "fp32": "trains with float32 parameters",
    "bf16": "trains with bfloat16 parameters (and its kernels take bfloat16 inputs)",
    "fp16": "its kernels take float16 inputs",
    "fsdp2": "FSDP2 (fully_shard) works over its collective library",
    "dcp": "torch.distributed.checkpoint saves and loads sharded state on it",
    "triton": "its kernels are Triton kernels (informational)",
}
CAPABILITY_PREFIXES: dict[str, str] = {
    "rollout:": "rollout:<engine> — the rollout engine <engine> runs on it (one per entry of rollout_engines)",
    "x-": "x-<name> — private to the plugin; polyrl never reads it",
}


def unknown_capabilities(capabilities: frozenset[str] | set[str]) -> list[str]:
    """The names in ``capabilities`` outside the vocabulary (sorted)."""
    return sorted(c for c in capabilities
                  if c not in CAPABILITIES and not any(c.startswith(p) and len(c) > len(p) for p in CAPABILITY_PREFIXES))


class Introspection(BackendPart):
    """Reached as ``backend.introspection``."""

    methods: ClassVar[tuple[str, ...]] = ("compatibility", "provided_kernels", "kernels_fallback",
                                          "declaration_warnings", "origin", "describe", "kernel_choices")

    def compatibility(self) -> Compatibility:
        """This backend's rows of the compatibility table that ``polyrl doctor`` checks: the distributions to
        report for it, facts read from the machine (a toolkit's version), and rules (polyrl.core.compat). Read
        metadata and files only, never import a vendor module. Default: none beyond core's own rows."""
        from polyrl.core.compat import Compatibility

        return Compatibility()

    def provided_kernels(self) -> frozenset[str]:
        """The kernels this backend provides itself: its slot names another function than the reference, or it
        overrides the kernel method. The reference backend's kernels are its own."""
        from polyrl.core.plugins.protocol import BackendCore

        backend = self.backend
        if backend.is_reference:
            return frozenset(KERNELS)
        return frozenset(
            k for k, path in backend.kernel_paths().items()
            if path != REFERENCE_KERNELS[k] or getattr(type(backend), k) is not getattr(BackendCore, k)
        )

    def kernels_fallback(self) -> list[str]:
        provided = self.provided_kernels()
        return [k for k in KERNELS if k not in provided]

    def declaration_warnings(self) -> list[str]:
        unknown = unknown_capabilities(self.backend.capabilities)
        if not unknown:
            return []
        # Self-contained (an installed wheel has no docs/): the vocabulary itself, and the prefixes.
        known = ", ".join(CAPABILITIES) + ", " + ", ".join(f"{p}<name>" for p in CAPABILITY_PREFIXES)
        return [f"unknown capabilities {unknown} (known: {known}; x-<name> is private to the plugin)"]

    def origin(self) -> str:
        """``"cuda (polyrl 0.1.0)"``: the backend, its distribution and version (the run log's first line)."""
        backend = self.backend
        dist = " ".join(x for x in (backend.distribution, backend.version) if x) or "registered in-process"
        return f"{backend.name} ({dist})"

    def kernel_choices(self) -> dict[str, dict[str, str]]:
        """For a kernel whose slot picks an implementation per call (by layout, dtype, device): kernel name ->
        {case: "what runs (why)"}, printed by ``polyrl backends``. Must not import a vendor module nor touch a
        device. Default: none."""
        return {}

    def describe(self) -> dict[str, Any]:
        """What ``polyrl backends --json`` prints for the backend."""
        backend = self.backend
        avail = backend.availability()
        warnings = self.declaration_warnings()
        try:
            choices = self.kernel_choices()
        except Exception as exc:  # a plugin's bug must not take the command down
            choices = {}
            warnings = [*warnings, f"kernel_choices() raised {one_line(exc)}"]
        return {
            "name": backend.name,
            "version": backend.version,
            "distribution": backend.distribution,
            "device_type": backend.device_type,
            "collective_backend": backend.collective_backend,
            "is_accelerator": bool(backend.is_accelerator),
            "is_reference": bool(backend.is_reference),
            "available": avail.available,
            "reason": avail.reason,
            "capabilities": sorted(backend.capabilities),
            "kernels": backend.kernel_paths(),
            "native_kernels": sorted(self.provided_kernels()),
            "kernels_fallback": self.kernels_fallback(),
            "rollout_engines": list(backend.rollout_engines),
            # per engine: "" when it can run here, else why not (``rollout_engine_problem``, isolated)
            "rollout_engine_problems": {e: backend.engines.problem(e) for e in backend.rollout_engines},
            "problems": backend.declaration_problems(),
            "warnings": warnings,
            "kernel_choices": choices,
        }
