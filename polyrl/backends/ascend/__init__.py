"""The ascend backend: torch_npu attention, HCCL, rollout with vllm-ascend (or the hf engine).

``torch_npu`` is never imported here at module level: importing it without Ascend's CANN breaks even
``import torch``. ``detect`` looks for the module spec, the CANN toolkit and the device nodes only.
``varlen_attention`` runs ``torch_npu.npu_fusion_attention`` (polyrl.backends.ascend.attention), imported on
first call; it has been run only against the CPU emulator of the documented API, never on an NPU here.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from polyrl.core.plugins.backend import Availability, Backend, ShardingPolicy
from polyrl.core.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from polyrl.core.compat import Compatibility


def cann_home() -> str | None:
    """The CANN toolkit directory, from the environment set by CANN's set_env.sh or the default path."""
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        path = os.environ.get(var)
        if path and os.path.isdir(path):
            return path
    default = "/usr/local/Ascend/ascend-toolkit/latest"
    return default if os.path.isdir(default) else None


class AscendBackend(Backend):
    name = "ascend"
    device_type = "npu"
    collective_backend = "hccl"
    capabilities = frozenset({"bf16", "fp16", "fsdp2", "dcp", "rollout:hf", "rollout:vllm"})
    is_accelerator = True
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

    def compatibility(self) -> Compatibility:
        from polyrl.backends.ascend import compat

        return compat.compatibility()

    def detect(self) -> Availability:
        if importlib.util.find_spec("torch_npu") is None:
            return Availability(False, "torch_npu is not installed (install the build matching your CANN)")
        if cann_home() is None:
            return Availability(False, "torch_npu is installed but Ascend CANN was not found (source set_env.sh)")
        if not glob.glob("/dev/davinci[0-9]*"):
            return Availability(False, "no Ascend NPU device node (/dev/davinciN) is visible")
        return Availability(True, "")

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
