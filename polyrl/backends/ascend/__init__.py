"""The ascend backend: torch_npu attention, HCCL, rollout with vllm-ascend (or the hf engine).

``torch_npu`` is never imported here at module level: importing it without Ascend's CANN breaks even
``import torch``. ``detect`` looks for the module spec, the CANN toolkit and the device nodes only.
``varlen_attention`` runs ``torch_npu.npu_fusion_attention`` (polyrl.backends.ascend.attention), imported on
first call; it has been run only against the CPU emulator of the documented API, never on an NPU here.

CPU mode (``POLYRL_ASCEND_ON_CPU=1``; ``polyrl run/parity --emulate`` sets it, polyrl.emulation): the
same backend code with the host as its device and, as its collective library, gloo behind HCCL's checks (the
``hccl_emulated`` process group that polyrl.emulation registers: HCCL's dtypes and reduce ops, its error text,
the all-to-all types of the emulated release), so that whole recipes run
against any stand-in module ``torch_npu`` (the packaged emulator, polyrl.emulation.npu). The backend is
then available whenever a module ``torch_npu`` is importable or already in ``sys.modules``, and of that module
it calls only ``npu_fusion_attention``, ``npu_fusion_attention_grad``, ``npu_grouped_matmul`` and
``npu_grouped_matmul_add_`` (MoE experts, polyrl.backends.ascend.experts), ``__version__`` and, where present,
``npu.utils.get_cann_version`` and ``npu.get_device_name`` (the chip, polyrl.backends.ascend.chip). Nothing in
CPU mode says anything about an NPU: it proves the backend's code paths against the documented API.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import math
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
# The torch.distributed backend of CPU mode: gloo with HCCL's rules (polyrl.emulation.hccl registers it).
ON_CPU_COLLECTIVE = "hccl_emulated"
# What HCCL reduces (checkSupportedDataType, Ascend/pytorch torch_npu/csrc/distributed/ProcessGroupHCCL.cpp
# @v7.3.0-pytorch2.8.0, l. 152-166): no float64 before Ascend 950, no uint8 / bool (allreduce casts those two to
# int32 itself; reduce_scatter refuses them). Gathers and broadcasts take every dtype. No world size is refused:
# ProcessGroupHCCL's _allgather_base / _reduce_scatter_base check tensor sizes only.
HCCL_REDUCE_DTYPES = frozenset({"int8", "int16", "int32", "int64", "float16", "float32", "bfloat16"})
# What HCCL's all-to-all exchanges (HcclAlltoAllV's send types in Ascend/pytorch third_party/hccl/inc/hccl/hccl.h):
# @v7.2.0-pytorch2.8.0 int8, int32, int64, uint64, float16, float32; @v7.3.0-pytorch2.8.0 (torch_npu 2.8.0.post2,
# and every later release) also bfloat16, float64 and the other integer types. ``AscendBackend.all_to_all`` sends
# another dtype as its bytes on the older releases only.
HCCL_ALL_TO_ALL_DTYPES = frozenset({"int8", "int32", "int64", "uint64", "float16", "float32"})
HCCL_ALL_TO_ALL_DTYPES_7_3 = HCCL_ALL_TO_ALL_DTYPES | frozenset(
    {"int16", "uint8", "bool", "uint16", "uint32", "float64", "bfloat16"})


def all_to_all_dtypes() -> frozenset[str]:
    """HcclAlltoAllV's types for the installed torch_npu (or its stand-in in CPU mode)."""
    module = sys.modules.get("torch_npu")
    if module is None:
        import torch_npu as module  # already imported on an NPU machine (the device is its)
    return _all_to_all_dtypes(str(getattr(module, "__version__", "")))


@functools.lru_cache(maxsize=8)
def _all_to_all_dtypes(version: str) -> frozenset[str]:
    from polyrl.backends.ascend.compat import torch_npu_at_least

    return HCCL_ALL_TO_ALL_DTYPES_7_3 if torch_npu_at_least(version, "7.3.0") else HCCL_ALL_TO_ALL_DTYPES


def on_cpu() -> bool:
    """CPU mode: the ascend backend's code on the host, against a stand-in ``torch_npu`` (read at each use, so
    that switching it on after the plugins loaded takes effect)."""
    return os.environ.get(ON_CPU_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class AscendBackend(Backend):
    name = "ascend"
    collective_reduce_dtypes = HCCL_REDUCE_DTYPES
    capabilities = frozenset({"bf16", "fp16", "fsdp2", "dcp", "rollout:hf", "rollout:vllm"})
    is_accelerator = True
    # GiB per device for the dry-run memory plan (the nominal HBM; the first is the default).
    device_memory_table: ClassVar[dict[str, float]] = {"910B": 64.0, "910B4": 32.0}
    attention_kernel = "polyrl.backends.ascend.attention:npu_varlen_attention"
    selfcheck_module = "polyrl.backends.ascend.selfcheck"  # the first run on hardware: polyrl doctor --selfcheck
    # MoE experts through npu_grouped_matmul (op-plugin has no torch._grouped_mm for the NPU, transformers' default)
    experts_kernel = "polyrl.backends.ascend.experts:npu_experts"
    # vllm-ascend preferred (rollout.engine: auto) where installed; the hf engine otherwise. Never run here (no
    # NPU); its settings per release: polyrl.backends.ascend.rollout (sleep-mode allocator, weight sync without
    # reload_weights before 0.24, GPT-OSS sinks from 0.15, its sliding-window convention).
    rollout_engines = ("vllm", "hf")

    def rollout_engine_problem(self, engine: str) -> str:
        from polyrl.backends.vllm_engine import vllm_problem

        if engine != "vllm":
            return ""
        return vllm_problem("vllm") or vllm_problem("vllm-ascend", "vllm_ascend")

    def rollout_engine_options(self, engine: str) -> dict[str, Any]:
        if engine != "vllm":
            return {}
        from polyrl.backends.ascend.compat import installed_vllm_ascend
        from polyrl.backends.ascend.rollout import vllm_options

        return vllm_options(installed_vllm_ascend())

    # The device and the collective library: the NPU and HCCL, or the host and gloo in CPU mode.
    @property
    def device_type(self) -> str:  # type: ignore[override]
        return "cpu" if on_cpu() else "npu"

    @property
    def collective_backend(self) -> str:  # type: ignore[override]
        return ON_CPU_COLLECTIVE if on_cpu() else "hccl"

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
        if not on_cpu():
            return super().process_group_options(local_rank)
        import torch.distributed as dist

        if ON_CPU_COLLECTIVE.upper() not in dist.Backend._plugins:
            from polyrl.core.errors import BadInputError

            raise BadInputError(f"{ON_CPU_ENV}=1 needs the emulated HCCL process group: run with --emulate "
                                "(polyrl.emulation.enable_emulation registers it)")
        return {}

    def device_rng_state(self) -> Any:
        return None if on_cpu() else super().device_rng_state()

    def set_device_rng_state(self, state: Any) -> None:
        if not on_cpu():
            super().set_device_rng_state(state)

    def memory_metrics(self) -> dict[str, float]:
        return {} if on_cpu() else super().memory_metrics()

    def check_world_size(self, world_size: int) -> None:
        """FSDP2 on Ascend 950DT, where torch_npu marks ``fully_shard`` unsupported (also in CPU mode: the
        emulated run refuses what hardware would)."""
        super().check_world_size(world_size)
        if world_size > 1:
            from polyrl.backends.ascend.chip import check_fully_shard_supported

            check_fully_shard_supported()

    def sharding_policy(self) -> ShardingPolicy:
        env = {"HCCL_CONNECT_TIMEOUT": "1200"}
        # Expandable segments ease fragmentation, but vllm-ascend's sleep mode (CaMemAllocator) asserts they are
        # off, and the allocator's setting is read once, before the engine is chosen: set only where the vllm
        # engine cannot run (vllm-ascend not installed).
        if self.rollout_engine_problem("vllm"):
            env["PYTORCH_NPU_ALLOC_CONF"] = "expandable_segments:True"
        return ShardingPolicy(
            param_dtype="bfloat16",
            reduce_dtype="float32",
            cpu_offload_supported=True,
            env_defaults=env,
        )

    def all_to_all(self, output: Any, input: Any, output_split_sizes: list[int] | None,
                   input_split_sizes: list[int] | None, group: Any = None) -> None:
        """``Backend.all_to_all`` within HCCL's all-to-all dtypes. From torch_npu 2.8.0.post2 (TorchNPU 7.3.0) that
        includes the bf16 rows of expert parallelism: they go as they are. On older releases a tensor of another
        dtype travels as its bytes, each row viewed as int8, so it arrives bit for bit, with no conversion and no
        more bytes on the wire. The split sizes count rows, which the view keeps; a rank may send or receive no
        rows at all (a 0-row tensor: decode with many expert-parallel ranks)."""
        import torch

        if str(input.dtype).removeprefix("torch.") in all_to_all_dtypes():
            super().all_to_all(output, input, output_split_sizes, input_split_sizes, group)
            return
        if input.dim() == 0 or output.dim() == 0:
            raise ValueError("all_to_all exchanges rows: expected tensors with a first dimension")

        def as_bytes(t: Any) -> Any:
            # the row width from the shape, not from reshape(-1): that cannot infer it for a 0-row tensor
            return t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.int8)

        target = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
        super().all_to_all(as_bytes(target), as_bytes(input.contiguous()), output_split_sizes, input_split_sizes,
                           group)
        if target is not output:
            output.copy_(target)


@hookimpl
def polyrl_register_backends(register: Callable[[type], None]) -> None:
    register(AscendBackend)
