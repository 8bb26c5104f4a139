"""The placement part of a backend: where what is not a model or a batch lives (random generators and their
saved states), how much memory a device has, and what the backend imposes on FSDP2 sharding.

The rule, for every built-in backend (docs/devices.md): every random generator the trainer owns lives on the CPU
(``generator``), so a checkpoint's generator states load on any backend; sampling draws its uniforms on the host
from per-sequence CPU generators (polyrl.core.rollout.sampling), so no device generator is ever consumed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from polyrl.core.plugins.part import BackendPart

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class ShardingPolicy:
    """What a backend imposes on FSDP2 sharding, whatever the recipe chooses (the recipe's own choices —
    enabled, CPU offload, resharding — are ``polyrl.core.config.ShardingConfig``).

    ``param_dtype``/``reduce_dtype`` are torch dtype names ("float32", "bfloat16") so that the policy is
    printable and comparable without importing torch. ``world_sizes_refused`` lists world sizes the
    collective library cannot handle (none of polyrl's own backends has such a rule: HCCL's sources check
    tensor sizes only, docs/ascend.md), and
    ``world_size_rule`` says which rule refuses them (the refusal's message names it).
    """

    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    cpu_offload_supported: bool = True
    world_sizes_refused: tuple[int, ...] = ()
    world_size_rule: str = ""
    env_defaults: dict[str, str] = dataclasses.field(default_factory=dict)
    # FSDP reduces gradients with plain SUM instead of PREMUL_SUM (gloo and HCCL have no PREMUL_SUM; with the
    # divide factor 1.0 polyrl uses, the two are the same reduction, so SUM is the safe default everywhere).
    force_sum_reduction: bool = True

    def refusal(self, size: int, collective_backend: str) -> str | None:
        """Why the collective library refuses a process group of ``size`` ranks (the rule), or None."""
        if size not in self.world_sizes_refused:
            return None
        return self.world_size_rule or f"{collective_backend} refuses world sizes {list(self.world_sizes_refused)}"


class Placement(BackendPart):
    """Generators, device memory, the sharding policy. Reached as ``backend.placement``."""

    methods: ClassVar[tuple[str, ...]] = ("sharding_policy", "check_world_size", "generator", "device_rng_state",
                                          "set_device_rng_state", "memory_metrics", "device_memory_gib",
                                          "device_graph")

    def sharding_policy(self) -> ShardingPolicy:
        return ShardingPolicy()

    def check_world_size(self, world_size: int) -> None:
        """Refuse world sizes the collective library cannot handle, with a clear message."""
        from polyrl.core.errors import BadInputError

        rule = self.sharding_policy().refusal(world_size, self.backend.collective_backend)
        if rule is not None:
            raise BadInputError(f"backend {self.backend.name!r}: world size {world_size} is refused: {rule}")

    def generator(self, seed: int) -> torch.Generator:
        """A seeded random generator for host-side decisions (sampling seeds, mini-batch shuffles): on the CPU,
        so that its state is portable across backends and the streams are the same everywhere."""
        import torch

        return torch.Generator(device="cpu").manual_seed(seed)

    def device_rng_state(self) -> torch.Tensor | None:
        """The device's default generator state for a checkpoint (None when the device has none of its own)."""
        import torch

        return torch.get_device_module(self.backend.device_type).get_rng_state()

    def set_device_rng_state(self, state: torch.Tensor | None) -> None:
        if state is None:
            return
        import torch

        torch.get_device_module(self.backend.device_type).set_rng_state(state)

    def memory_metrics(self) -> dict[str, float]:
        """Per-step memory figures for metrics.jsonl: the device's peak allocated GiB since the last call."""
        import torch

        module = torch.get_device_module(self.backend.device_type)
        if not hasattr(module, "max_memory_allocated"):
            return {}
        peak = module.max_memory_allocated() / 2**30
        module.reset_peak_memory_stats()
        return {"memory/peak_gib": peak}

    def device_graph(self) -> Callable[..., Callable[[], None]] | None:
        """Graph capture on this backend's device, or None (the default) where it has none.

        Where it has one: ``capture(step, before_capture=None) -> replay``. ``step()`` reads no tensor value on the
        host and keeps its tensors' storage from call to call. ``capture`` runs ``step()`` once to warm up (lazy
        allocations, first compiles), then calls ``before_capture()`` so the caller can undo the warm-up's effect on
        its state. Then it records ``step`` without running it. ``replay()`` runs the recorded work on the device.
        The hf engine's ``rollout.decode: graph`` uses it (polyrl.core.rollout.static_decode). The cuda backend
        implements it with CUDA graphs."""
        return None

    def device_memory_gib(self, model: str | None = None, *, local_world_size: int = 1) -> tuple[str, float]:
        """(device model, GiB of memory of one device) from the backend's ``device_memory_table``, without touching
        a device. ``model`` None: the table's first entry. ``local_world_size``: processes per node (a backend
        whose processes share one memory, as the cpu backend's, divides by it)."""
        from polyrl.core.errors import BadInputError

        name, table = self.backend.name, self.backend.device_memory_table
        if not table:
            raise BadInputError(f"backend {name!r} declares no device memory; give it with --device-memory GIB")
        if model is None:
            model = next(iter(table))
        if model not in table:
            raise BadInputError(f"backend {name!r}: unknown device {model!r} (known: {', '.join(table)})")
        return model, float(table[model])
