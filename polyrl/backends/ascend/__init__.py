"""The ascend backend: torch_npu attention, HCCL, rollout with vllm-ascend (or the hf engine).

``torch_npu`` is never imported here at module level: importing it without Ascend's CANN breaks even
``import torch``. ``detect`` looks for the module spec, the CANN toolkit and the device nodes only.
``varlen_attention`` runs ``torch_npu.npu_fusion_attention`` (polyrl.backends.ascend.attention), imported on
first call; it has been run only against the CPU emulator of the documented API, never on an NPU here.

CPU mode (``POLYRL_ASCEND_ON_CPU=1``; ``polyrl run/parity --emulate`` sets it, polyrl.emulation): the
same backend code with the host as its device and gloo as its collective library, so that whole recipes run
against any stand-in module ``torch_npu`` (the packaged emulator, polyrl.emulation.npu). The backend is
then available whenever a module ``torch_npu`` is importable or already in ``sys.modules``, and of that module
it calls only ``npu_fusion_attention``, ``npu_fusion_attention_grad``, ``__version__`` and, where present,
``npu.utils.get_cann_version`` and ``npu.get_device_name`` (the chip, polyrl.backends.ascend.chip). Nothing in
CPU mode says anything about an NPU: it proves the backend's code paths against the documented API.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from polyrl.backends.ascend.compat import cann_home
from polyrl.core.plugins.backend import Availability, Backend, ShardingPolicy
from polyrl.core.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from polyrl.core.compat import Compatibility

ON_CPU_ENV = "POLYRL_ASCEND_ON_CPU"


def on_cpu() -> bool:
    """CPU mode: the ascend backend's code on the host, against a stand-in ``torch_npu`` (read at each use, so
    that switching it on after the plugins loaded takes effect)."""
    return os.environ.get(ON_CPU_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class AscendBackend(Backend):
    name = "ascend"
    capabilities = frozenset({"bf16", "fp16", "fsdp2", "dcp", "rollout:hf", "rollout:vllm"})
    is_accelerator = True
    # GiB per device for the dry-run memory plan (the nominal HBM; the first is the default).
    device_memory_table: ClassVar[dict[str, float]] = {"910B": 64.0, "910B4": 32.0}
    attention_kernel = "polyrl.backends.ascend.attention:npu_varlen_attention"
    # vllm-ascend preferred (rollout.engine: auto) where installed; the hf engine otherwise. Never run here (no
    # NPU). vllm-ascend's sliding-window attention passes pre_tokens = sliding_window (W + 1 keys where
    # training uses W): the sync probe measures that mismatch and stops the run (docs/rollout.md).
    rollout_engines = ("vllm", "hf")

    def rollout_engine_problem(self, engine: str) -> str:
        from polyrl.backends.vllm_engine import vllm_problem

        if engine != "vllm":
            return ""
        return vllm_problem("vllm") or vllm_problem("vllm-ascend", "vllm_ascend")

    def rollout_engine_options(self, engine: str) -> dict[str, Any]:
        if engine != "vllm":
            return {}
        return {
            # no NZ (fractal) weight layout: in-place weight updates write plain tensors; the engine core in-process
            "env": {"VLLM_ASCEND_ENABLE_NZ": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            "gpu_memory_utilization": 0.6,
            "sleep_level": 1,  # vllm-ascend supports level 1 only for RL
        }

    # The device and the collective library: the NPU and HCCL, or the host and gloo in CPU mode.
    @property
    def device_type(self) -> str:  # type: ignore[override]
        return "cpu" if on_cpu() else "npu"

    @property
    def collective_backend(self) -> str:  # type: ignore[override]
        return "gloo" if on_cpu() else "hccl"

    def compatibility(self) -> Compatibility:
        from polyrl.backends.ascend import compat

        return compat.compatibility()

    def detect(self) -> Availability:
        if on_cpu():
            if "torch_npu" in sys.modules or importlib.util.find_spec("torch_npu") is not None:
                return Availability(True, f"{ON_CPU_ENV}=1: torch_npu stand-in on the CPU (not an NPU)")
            return Availability(False, f"{ON_CPU_ENV}=1 but no module torch_npu is importable "
                                       "(polyrl run --emulate installs polyrl.emulation.npu)")
        if importlib.util.find_spec("torch_npu") is None:
            return Availability(False, "torch_npu is not installed (install the build matching your CANN)")
        if cann_home() is None:
            return Availability(False, "torch_npu is installed but Ascend CANN was not found (source set_env.sh)")
        if not glob.glob("/dev/davinci[0-9]*"):
            return Availability(False, "no Ascend NPU device node (/dev/davinciN) is visible")
        return Availability(True, "")

    # --- placement: torch's device-generic calls on the NPU; the host's trivial ones in CPU mode ----------
    def device(self, local_rank: int = 0) -> Any:
        import torch

        return torch.device("cpu") if on_cpu() else torch.device("npu", local_rank)

    def bind_device(self, local_rank: int = 0) -> Any:
        return self.device(local_rank) if on_cpu() else super().bind_device(local_rank)

    def process_group_options(self, local_rank: int = 0) -> dict[str, Any]:
        return {} if on_cpu() else super().process_group_options(local_rank)

    def device_rng_state(self) -> Any:
        return None if on_cpu() else super().device_rng_state()

    def set_device_rng_state(self, state: Any) -> None:
        if not on_cpu():
            super().set_device_rng_state(state)

    def memory_metrics(self) -> dict[str, float]:
        return {} if on_cpu() else super().memory_metrics()

    def check_world_size(self, world_size: int) -> None:
        """HCCL's refused world sizes (also in CPU mode: the emulated run refuses what hardware would), and
        FSDP2 on Ascend 950DT, where torch_npu marks ``fully_shard`` unsupported."""
        super().check_world_size(world_size)
        if world_size > 1:
            from polyrl.backends.ascend.chip import check_fully_shard_supported

            check_fully_shard_supported()

    def sharding_policy(self) -> ShardingPolicy:
        return ShardingPolicy(
            param_dtype="bfloat16",
            reduce_dtype="float32",
            cpu_offload_supported=True,
            # HCCL all_gather_into_tensor / reduce_scatter_tensor refuse these world sizes.
            world_sizes_refused=(3, 5, 6, 7),
            env_defaults={
                "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
                "HCCL_CONNECT_TIMEOUT": "1200",
            },
        )


@hookimpl
def polyrl_register_backends(register: Callable[[type], None]) -> None:
    register(AscendBackend)
