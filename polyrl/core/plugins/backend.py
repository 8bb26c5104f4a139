"""The Backend interface: what a hardware plugin declares and implements.

A backend is a small class, registered through the ``polyrl_register_backends`` hook. It must be cheap to
construct and must not touch a device in ``__init__`` or ``detect``: detection reads what is installed
and what the OS exposes, it never initialises a runtime (no CUDA context, no NPU init).

Everything a backend does not implement falls back explicitly to the reference implementation in core,
and the fallback is listed by ``polyrl backends`` (``kernels_fallback``).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

# Kernels a backend may provide natively; anything it does not list in ``native_kernels`` runs the
# reference implementation from polyrl.core.
KERNELS: tuple[str, ...] = ("varlen_attention", "logprobs")


@dataclasses.dataclass(frozen=True)
class Availability:
    available: bool
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class ShardingPolicy:
    """How FSDP2 should be applied on this backend.

    ``param_dtype``/``reduce_dtype`` are torch dtype names ("float32", "bfloat16") so that the policy is
    printable and comparable without importing torch. ``world_sizes_refused`` lists world sizes the
    collective library cannot handle (HCCL refuses 3, 5, 6, 7 for all_gather_into_tensor).
    """

    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    cpu_offload_supported: bool = True
    world_sizes_refused: tuple[int, ...] = ()
    env_defaults: dict[str, str] = dataclasses.field(default_factory=dict)


class Backend:
    """Base class of every backend. Subclasses set the class attributes and override what they provide."""

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = "cpu"  # torch device type: "cpu", "cuda", "npu", ...
    collective_backend: ClassVar[str] = "gloo"  # torch.distributed backend name
    capabilities: ClassVar[frozenset[str]] = frozenset()
    native_kernels: ClassVar[frozenset[str]] = frozenset()
    rollout_engines: ClassVar[tuple[str, ...]] = ("hf",)
    is_reference: ClassVar[bool] = False  # the cpu backend: the fallback, not an accelerator
    # "module:function" of the varlen attention kernel, with the signature of
    # polyrl.core.attention.reference.reference_varlen_attention (the default: the exact reference).
    attention_kernel: ClassVar[str] = "polyrl.core.attention.reference:reference_varlen_attention"

    # Filled in by the plugin manager: the distribution the backend came from.
    distribution: str = ""
    version: str = ""

    def detect(self) -> Availability:
        """Is the hardware and software present? Must not initialise a device."""
        raise NotImplementedError

    # --- kernels -------------------------------------------------------------------------------
    def varlen_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        scale: float,
        window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Packed causal attention with optional window and sinks (contract in polyrl.core.attention).

        Runs the function named by ``attention_kernel``, imported on first call so that vendor modules
        (triton, torch_npu) load only when a kernel actually runs. Override the method only when a
        backend needs more than a function call.
        """
        module_name, _, func_name = self.attention_kernel.partition(":")
        kernel = getattr(importlib.import_module(module_name), func_name)
        return kernel(q, k, v, cu_seqlens, scale=scale, window=window, sinks=sinks)

    # --- sharding / environment ---------------------------------------------------------------
    def sharding_policy(self) -> ShardingPolicy:
        return ShardingPolicy()

    def check_world_size(self, world_size: int) -> None:
        """Refuse world sizes the collective library cannot handle, with a clear message."""
        from polyrl.core.errors import BadInputError

        refused = self.sharding_policy().world_sizes_refused
        if world_size in refused:
            raise BadInputError(
                f"backend {self.name!r}: world size {world_size} is not supported by "
                f"{self.collective_backend} (refused sizes: {list(refused)})"
            )

    # --- device placement ----------------------------------------------------------------------
    # The one place that decides where things live (core never compares device types). The rule, for every
    # built-in backend (docs/devices.md): models, training batches, scores, masks and advantages live on
    # ``device(local_rank)``; every random generator the trainer owns lives on the CPU (``generator``), so a
    # checkpoint's generator states load on any backend; sampling draws its uniforms from a counter-based hash
    # on the compute device (polyrl.core.rollout.sampling), so no device generator is ever consumed.
    def device(self, local_rank: int = 0) -> Any:
        """The torch device of this process's rank. Only called once a run has started."""
        import torch

        return torch.device(self.device_type, local_rank)

    def bind_device(self, local_rank: int = 0) -> Any:
        """Make ``device(local_rank)`` the process's current device (before the process group exists, so the
        collective library does not guess); returns it. The default uses torch's device-generic module."""
        import torch

        device = self.device(local_rank)
        torch.get_device_module(self.device_type).set_device(device)
        return device

    def comm_device(self, local_rank: int = 0) -> Any:
        """Where tensors handed to a collective must live (nccl/hccl reduce device memory only)."""
        return self.device(local_rank)

    def process_group_options(self, local_rank: int = 0) -> dict[str, Any]:
        """Extra ``init_process_group`` arguments: by default the bound device (eager connection set-up)."""
        return {"device_id": self.device(local_rank)}

    def generator(self, seed: int) -> Any:
        """A seeded random generator for host-side decisions (sampling seeds, mini-batch shuffles): on the CPU,
        so that its state is portable across backends and the streams are the same everywhere."""
        import torch

        return torch.Generator(device="cpu").manual_seed(seed)

    def device_rng_state(self) -> Any:
        """The device's default generator state for a checkpoint (None when the device has none of its own)."""
        import torch

        return torch.get_device_module(self.device_type).get_rng_state()

    def set_device_rng_state(self, state: Any) -> None:
        if state is None:
            return
        import torch

        torch.get_device_module(self.device_type).set_rng_state(state)

    def memory_metrics(self) -> dict[str, float]:
        """Per-step memory figures for metrics.jsonl: the device's peak allocated GiB since the last call."""
        import torch

        module = torch.get_device_module(self.device_type)
        if not hasattr(module, "max_memory_allocated"):
            return {}
        peak = module.max_memory_allocated() / 2**30
        module.reset_peak_memory_stats()
        return {"memory/peak_gib": peak}

    # --- reporting -----------------------------------------------------------------------------
    def kernels_fallback(self) -> list[str]:
        return [k for k in KERNELS if k not in self.native_kernels]

    def describe(self) -> dict[str, Any]:
        avail = self.detect()
        return {
            "name": self.name,
            "version": self.version,
            "distribution": self.distribution,
            "device_type": self.device_type,
            "collective_backend": self.collective_backend,
            "available": avail.available,
            "reason": avail.reason,
            "capabilities": sorted(self.capabilities),
            "native_kernels": sorted(self.native_kernels),
            "kernels_fallback": self.kernels_fallback(),
            "rollout_engines": list(self.rollout_engines),
        }
