"""HCCL's rules on gloo: the process group the ascend backend opens in CPU mode (``polyrl run --emulate``).

An emulated run has no NPU and no HCCL; its collectives travel over gloo, which accepts what HCCL refuses. So
the ascend backend in CPU mode opens this process group instead (``torch.distributed`` backend
``hccl_emulated``): gloo underneath, with HCCL's checks in front of every collective, raising what
torch_npu's ``ProcessGroupHCCL`` raises, so that a code path a real cluster would stop on stops here too. It
says nothing about an NPU or about HCCL's numerics: the data moves exactly as gloo moves it.

The rules, from Ascend/pytorch (torch_npu) ``torch_npu/csrc/distributed/ProcessGroupHCCL.cpp`` on the
v2.9.0-7.3.0 branch, and torch_npu's documentation:

- ``checkSupportedDataType``: the reductions (allreduce, allreduce_coalesced, reduce, reduce_scatter,
  _reduce_scatter_base, reduce_scatter_tensor_coalesced) take int8, int16, int32, int64, float16, float32 and
  bfloat16 only — no float64 (Ascend 950 adds it on master), no uint8 or bool (bool travels as uint8). The
  message is HCCL's: ``HCCL allreduce: Unsupported data type at::kDouble`` followed by torch_npu's error code
  line (``ERR02007 DIST feature not supported``). Gathers and broadcasts take every dtype, as there.
- ``getHcclReduceOp``: ``Cannot use ReduceOp.AVG with HCCL`` (also BAND, BOR, BXOR); PREMUL_SUM, which the 7.3.0
  branches do not map, is ``Unhandled ReduceOp``.
- all_gather_into_tensor / reduce_scatter_tensor (and their coalesced forms, FSDP2's collectives) refuse world
  sizes 3, 5, 6 and 7. HCCL's own wording of that refusal is not public: the message here is polyrl's, naming
  the rule.

- all_to_all (``alltoall_base``, ``alltoall``) exchanges only HcclAlltoAllV's types (hccl.h): int8, int32, int64,
  uint64, float16, float32; bfloat16 is refused.

Not emulated: HCCL's timeouts and buffer sizes.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

BACKEND_NAME = "hccl_emulated"

REDUCE_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16})
WORLD_SIZES_REFUSED: tuple[int, ...] = (3, 5, 6, 7)
ALL_TO_ALL_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.int8, torch.int32, torch.int64, torch.uint64, torch.float16, torch.float32})
WORLD_SIZE_RULE = ("HCCL's all_gather_into_tensor / reduce_scatter_tensor (FSDP2's collectives) refuse world sizes "
                   f"{', '.join(map(str, WORLD_SIZES_REFUSED))}")

# torch_npu's names for the dtypes (kHcclDataTypeToStringMap, HCCLUtils.cpp); a dtype HCCL has no type for is
# refused before the check (getHcclDataType).
_SERIAL = {torch.uint8: "at::kByte/at::kBool", torch.bool: "at::kByte/at::kBool", torch.int8: "at::kChar",
           torch.int16: "at::kShort", torch.int32: "at::kInt", torch.int64: "at::kLong", torch.float16: "at::kHalf",
           torch.float32: "at::kFloat", torch.float64: "at::kDouble", torch.bfloat16: "at::kBFloat16"}
# DIST_ERROR(ErrCode::NOT_SUPPORT) (NPUException.cpp) appends a line "[ERROR] <time> (PID:..., Device:...,
# RankID:...) ERR02007 DIST feature not supported"; its variable part is left out.
_NOT_SUPPORTED = "\n[ERROR] (emulated HCCL on gloo, not an NPU) ERR02007 DIST feature not supported"
_REFUSED_OPS = {dist.ReduceOp.AVG: "AVG", dist.ReduceOp.BAND: "BAND", dist.ReduceOp.BOR: "BOR",
                dist.ReduceOp.BXOR: "BXOR"}
_MAPPED_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT)


def check_dtype(tensor: torch.Tensor, function: str) -> None:
    """HCCL's ``getHcclDataType`` + ``checkSupportedDataType`` for the reduction ``function``."""
    if tensor.dtype not in _SERIAL:
        raise RuntimeError("Unsupported data type for HCCL process group" + _NOT_SUPPORTED)
    if tensor.dtype not in REDUCE_DTYPES:
        raise RuntimeError(f"HCCL {function}: Unsupported data type {_SERIAL[tensor.dtype]}" + _NOT_SUPPORTED)


def check_all_to_all_dtype(tensor: torch.Tensor, function: str) -> None:
    """HcclAlltoAllV's send / receive types (hccl.h): int8, int32, int64, uint64, float16, float32."""
    if tensor.dtype not in _SERIAL and tensor.dtype != torch.uint64:
        raise RuntimeError("Unsupported data type for HCCL process group" + _NOT_SUPPORTED)
    if tensor.dtype not in ALL_TO_ALL_DTYPES:
        raise RuntimeError(f"HCCL {function}: Unsupported data type {_SERIAL[tensor.dtype]} (HcclAlltoAllV takes "
                           "int8, int32, int64, uint64, float16, float32; emulated rule)" + _NOT_SUPPORTED)


def check_reduce_op(op: Any) -> None:
    """HCCL's ``getHcclReduceOp`` on the 7.3.0 branches."""
    for refused, name in _REFUSED_OPS.items():
        if op == refused:
            raise RuntimeError(f"Cannot use ReduceOp.{name} with HCCL" + _NOT_SUPPORTED)
    if not any(op == mapped for mapped in _MAPPED_OPS):  # PREMUL_SUM
        raise RuntimeError("Unhandled ReduceOp\n[ERROR] (emulated HCCL on gloo, not an NPU) ERR02008 DIST resource "
                           "not found")


def check_world_size(size: int, function: str) -> None:
    if size in WORLD_SIZES_REFUSED:
        raise RuntimeError(f"HCCL {function}: world size {size} is not supported ({WORLD_SIZE_RULE}; emulated rule)")


def _done(result: Any) -> Any:
    """A finished Work (the coalesced forms run their parts one by one, each waited for)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


class EmulatedHcclProcessGroup(dist.ProcessGroup):
    """A ProcessGroup whose collectives check HCCL's rules, then run on an inner gloo backend.

    Every collective method of ``torch.distributed.ProcessGroup`` is overridden (a method left out would reach
    gloo unchecked): ``torch.distributed``'s functions and the functional collectives DTensor uses both call
    these methods. The gloo backend is also registered on the group, which gives it its name and device."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, self._gloo)

    def getBackendName(self) -> str:  # torch's method name
        return BACKEND_NAME

    # --- reductions: HCCL's dtype and reduce-op checks ----------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        check_dtype(tensors[0], "allreduce")
        check_reduce_op(opts.reduceOp)
        return self._gloo.allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        for t in tensors:
            check_dtype(t, "allreduce_coalesced")
        check_reduce_op(opts.reduceOp)
        return self._gloo.allreduce_coalesced(tensors, opts)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        check_dtype(tensors[0], "reduce")
        check_reduce_op(opts.reduceOp)
        return self._gloo.reduce(tensors, opts)

    def reduce_scatter(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        check_dtype(outputs[0], "reduce_scatter")
        check_reduce_op(opts.reduceOp)
        return self._gloo.reduce_scatter(outputs, inputs, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        check_world_size(self.size(), "_reduce_scatter_base")
        check_dtype(input, "_reduce_scatter_base")
        check_reduce_op(opts.reduceOp)
        return self._gloo._reduce_scatter_base(output, input, opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        check_world_size(self.size(), "reduce_scatter_tensor_coalesced")
        for t in inputs:
            check_dtype(t, "reduce_scatter_tensor_coalesced")
        check_reduce_op(opts.reduceOp)
        for out, inp in zip(outputs, inputs):
            self._gloo._reduce_scatter_base(out, inp, opts).wait()
        return _done(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # --- gathers into one tensor: HCCL's world-size rule; any dtype ---------------------------------------
    def all_gather_single(self, output, input, opts=None):
        check_world_size(self.size(), "_allgather_base")
        return self._gloo._allgather_base(output, input, opts if opts is not None else dist.AllgatherOptions())

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        check_world_size(self.size(), "allgather_into_tensor_coalesced")
        for out, inp in zip(outputs, inputs):
            self._gloo._allgather_base(out, inp).wait()
        return _done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # --- everything else: HCCL takes every dtype and size here ---------------------------------------------
    def allgather(self, outputs, inputs, opts=None):
        return self._gloo.allgather(outputs, inputs, opts if opts is not None else dist.AllgatherOptions())

    def allgather_coalesced(self, outputs, inputs, opts=None):
        return self._gloo.allgather_coalesced(outputs, inputs, opts if opts is not None else dist.AllgatherOptions())

    def broadcast(self, tensors, opts=None):
        return self._gloo.broadcast(tensors, opts if opts is not None else dist.BroadcastOptions())

    def gather(self, outputs, inputs, opts=None):
        return self._gloo.gather(outputs, inputs, opts if opts is not None else dist.GatherOptions())

    def scatter(self, outputs, inputs, opts=None):
        return self._gloo.scatter(outputs, inputs, opts if opts is not None else dist.ScatterOptions())

    def alltoall(self, outputs, inputs, opts=None):
        for t in inputs:
            check_all_to_all_dtype(t, "alltoall")
        return self._gloo.alltoall(outputs, inputs, opts if opts is not None else dist.AllToAllOptions())

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        check_all_to_all_dtype(input, "alltoall_base")
        return self._gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                        opts if opts is not None else dist.AllToAllOptions())

    alltoall_base = all_to_all_single

    def send(self, tensors, dst, tag=0):
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        return self._gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag=0):
        return self._gloo.recv_anysource(tensors, tag)

    def barrier(self, opts=None):
        return self._gloo.barrier(opts if opts is not None else dist.BarrierOptions())

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return self._gloo.monitored_barrier(timeout, wait_all_ranks)


def _create(backend_opts: Any, _pg_options: Any) -> EmulatedHcclProcessGroup:
    return EmulatedHcclProcessGroup(backend_opts.store, backend_opts.group_rank, backend_opts.group_size,
                                    backend_opts.timeout)


def register() -> str:
    """Make ``init_process_group(backend="hccl_emulated")`` (and ``new_group`` under it) open this group; returns
    the name. Idempotent."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
    return BACKEND_NAME
