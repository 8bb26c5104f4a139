"""HCCL's rules on gloo: the process group the ascend backend opens in CPU mode (``polyrl run --emulate``).

An emulated run has no NPU and no HCCL; its collectives travel over gloo, which accepts what HCCL refuses. So
the ascend backend in CPU mode opens this process group instead (``torch.distributed`` backend
``hccl_emulated``): gloo underneath, with HCCL's checks in front of every collective, raising what
torch_npu's ``ProcessGroupHCCL`` raises, so that a code path a real cluster would stop on stops here too. It
says nothing about an NPU or about HCCL's numerics: the data moves exactly as gloo moves it.

Every rule cites where it is written (Ascend/pytorch, the torch_npu sources; PG = ``torch_npu/csrc/distributed/
ProcessGroupHCCL.cpp``, HDR = ``third_party/hccl/inc/hccl/hccl.h``). A rule without a source is not emulated:
an earlier world-size rule ("3, 5, 6, 7 refused by all_gather_into_tensor / reduce_scatter_tensor") had none —
PG@v7.3.0-pytorch2.8.0 ``_allgather_base`` / ``_reduce_scatter_base`` check only the sizes of the tensors — and
is gone.

- Reduction dtypes: ``checkSupportedDataType`` (PG@v7.3.0-pytorch2.8.0, l. 152-166) takes int8, int16, int32,
  int64, float16, float32 and bfloat16 — no float64, no uint8 / bool. Its message is
  ``HCCL allreduce: Unsupported data type at::kDouble`` then torch_npu's error code line (``ERR02007 DIST feature
  not supported``). A dtype HCCL has no type for at all: ``Unsupported data type for HCCL process group``
  (``getHcclDataType``, torch_npu/csrc/distributed/HCCLUtils.cpp@v7.3.0-pytorch2.8.0, l. 83).
- bool / uint8 in allreduce, allreduce_coalesced, reduce and _reduce_oop are cast to int32 before the call and
  copied back after it (PG@v7.3.0-pytorch2.8.0, l. 3976, 4148, 4211, 4271), so the op reduces the int32 copy
  (a bool SUM copied back is the OR). reduce_scatter and _reduce_scatter_base have no such cast: bool is refused.
- Reduce ops (``getHcclReduceOp``, PG@v7.3.0-pytorch2.8.0, l. 127-150): AVG is a SUM followed by a division by
  the group size on the output (``tensor.div_(getSize())`` in every reduction's post hook); BAND / BOR / BXOR:
  ``Cannot use ReduceOp.BAND with HCCL``; anything else unmapped (PREMUL_SUM): ``Unhandled ReduceOp``.
- all-to-all (``alltoall_base``, ``alltoall``, both HcclAlltoAllV): the send types HDR lists for the release of the
  torch_npu being emulated — HDR@v7.2.0-pytorch2.8.0: int8, int32, int64, uint64, float16, float32;
  HDR@v7.3.0-pytorch2.8.0 (torch_npu 2.8.0.post2, and every 7.3.0 and later release): also int16, uint8,
  uint16, uint32, float64, bfloat16. ProcessGroupHCCL does not check them itself (HCCL fails the call), so the
  message is polyrl's, marked as emulated.
- Gathers, broadcasts, scatters, sends: every dtype and every world size ("AllGather & Broadcast support all
  data type", PG@v7.3.0-pytorch2.8.0, l. 151).

Not emulated: HCCL's timeouts and buffer sizes.
"""

from __future__ import annotations

import datetime
import sys
from typing import Any

import torch
import torch.distributed as dist

BACKEND_NAME = "hccl_emulated"

REDUCE_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16})
# Cast to int32 around allreduce / reduce (PG@v7.3.0-pytorch2.8.0, l. 3976).
CAST_TO_INT32: frozenset[torch.dtype] = frozenset({torch.bool, torch.uint8})
# HcclAlltoAllV's send types per TorchNPU release (HDR at the tags above).
ALL_TO_ALL_DTYPES_7_2: frozenset[torch.dtype] = frozenset(
    {torch.int8, torch.int32, torch.int64, torch.uint64, torch.float16, torch.float32})
ALL_TO_ALL_DTYPES_7_3: frozenset[torch.dtype] = ALL_TO_ALL_DTYPES_7_2 | frozenset(
    {torch.int16, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.float64, torch.bfloat16})

# torch_npu's names for the dtypes (kHcclDataTypeToStringMap, HCCLUtils.cpp); a dtype HCCL has no type for is
# refused before the check (getHcclDataType).
_SERIAL = {torch.uint8: "at::kByte/at::kBool", torch.bool: "at::kByte/at::kBool", torch.int8: "at::kChar",
           torch.int16: "at::kShort", torch.int32: "at::kInt", torch.int64: "at::kLong", torch.float16: "at::kHalf",
           torch.float32: "at::kFloat", torch.float64: "at::kDouble", torch.bfloat16: "at::kBFloat16",
           torch.uint16: "at::kUInt16", torch.uint32: "at::kUInt32", torch.uint64: "at::kUInt64"}
# DIST_ERROR(ErrCode::NOT_SUPPORT) (NPUException.cpp) appends a line "[ERROR] <time> (PID:..., Device:...,
# RankID:...) ERR02007 DIST feature not supported"; its variable part is left out.
_NOT_SUPPORTED = "\n[ERROR] (emulated HCCL on gloo, not an NPU) ERR02007 DIST feature not supported"
_REFUSED_OPS = {dist.ReduceOp.BAND: "BAND", dist.ReduceOp.BOR: "BOR", dist.ReduceOp.BXOR: "BXOR"}
_MAPPED_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT, dist.ReduceOp.AVG)


def all_to_all_dtypes() -> frozenset[torch.dtype]:
    """HcclAlltoAllV's types for the torch_npu in ``sys.modules`` (the emulator's release; 7.3.0's without one)."""
    from polyrl.emulation.npu_releases import release_at_least, release_of

    version = str(getattr(sys.modules.get("torch_npu"), "__version__", "") or "2.9.0")
    return ALL_TO_ALL_DTYPES_7_3 if release_at_least(release_of(version), "7.3.0") else ALL_TO_ALL_DTYPES_7_2


def check_dtype(tensor: torch.Tensor, function: str) -> None:
    """HCCL's ``getHcclDataType`` + ``checkSupportedDataType`` for the reduction ``function``."""
    if tensor.dtype not in _SERIAL or tensor.dtype in (torch.uint16, torch.uint32, torch.uint64):
        raise RuntimeError("Unsupported data type for HCCL process group" + _NOT_SUPPORTED)
    if tensor.dtype not in REDUCE_DTYPES:
        raise RuntimeError(f"HCCL {function}: Unsupported data type {_SERIAL[tensor.dtype]}" + _NOT_SUPPORTED)


def check_all_to_all_dtype(tensor: torch.Tensor, function: str) -> None:
    """HcclAlltoAllV's send / receive types (HDR of the emulated release)."""
    if tensor.dtype not in _SERIAL:
        raise RuntimeError("Unsupported data type for HCCL process group" + _NOT_SUPPORTED)
    allowed = all_to_all_dtypes()
    if tensor.dtype not in allowed:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in allowed))
        raise RuntimeError(f"HCCL {function}: Unsupported data type {_SERIAL[tensor.dtype]} (HcclAlltoAllV of this "
                           f"torch_npu takes {names}; emulated rule)" + _NOT_SUPPORTED)


def check_reduce_op(op: Any) -> None:
    """HCCL's ``getHcclReduceOp`` on the 7.3.0 branches (AVG is accepted: a SUM, then a division)."""
    for refused, name in _REFUSED_OPS.items():
        if op == refused:
            raise RuntimeError(f"Cannot use ReduceOp.{name} with HCCL" + _NOT_SUPPORTED)
    if not any(op == mapped for mapped in _MAPPED_OPS):  # PREMUL_SUM
        raise RuntimeError("Unhandled ReduceOp\n[ERROR] (emulated HCCL on gloo, not an NPU) ERR02008 DIST resource "
                           "not found")


def _done(result: Any) -> Any:
    """A finished Work (the collectives here wait for gloo, then apply HCCL's post hooks)."""
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

    # --- reductions: HCCL's dtype and reduce-op checks, its int32 cast and its AVG ------------------------
    def _reduce(self, tensors: list[torch.Tensor], opts: Any, function: str, run: Any, cast: bool,
                outputs: list[torch.Tensor] | None = None) -> Any:
        """Run ``run(tensors, opts)`` on gloo as HCCL would: bool / uint8 on an int32 copy where ``cast``
        (copied back after), AVG as SUM then a division of ``outputs`` (default: ``tensors``) by the size."""
        work = [t.to(torch.int32) if cast and t.dtype in CAST_TO_INT32 else t for t in tensors]
        for t in work:
            check_dtype(t, function)
        check_reduce_op(opts.reduceOp)
        if all(a is b for a, b in zip(work, tensors)) and opts.reduceOp != dist.ReduceOp.AVG:
            return run(tensors, opts)
        avg = opts.reduceOp == dist.ReduceOp.AVG
        if avg:
            opts.reduceOp = dist.ReduceOp.SUM
        try:
            run(work, opts).wait()
        finally:
            if avg:
                opts.reduceOp = dist.ReduceOp.AVG
        for t in (work if outputs is None else outputs) if avg else ():
            t.div_(self.size())
        for a, b in zip(work, tensors):
            if a is not b:
                b.copy_(a)
        return _done(tensors)

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        return self._reduce(tensors, opts, "allreduce", self._gloo.allreduce, cast=True)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._reduce(tensors, opts, "allreduce_coalesced", self._gloo.allreduce_coalesced, cast=True)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._reduce(tensors, opts, "reduce", self._gloo.reduce, cast=True)

    def reduce_scatter(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._reduce(outputs, opts, "reduce_scatter", lambda o, op: self._gloo.reduce_scatter(o, inputs, op),
                            cast=False)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        check_dtype(input, "_reduce_scatter_base")
        return self._reduce([output], opts, "_reduce_scatter_base",
                            lambda o, op: self._gloo._reduce_scatter_base(o[0], input, op), cast=False)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        for t in inputs:
            check_dtype(t, "reduce_scatter_tensor_coalesced")

        def run(outs, op):
            for out, inp in zip(outs, inputs):
                self._gloo._reduce_scatter_base(out, inp, op).wait()
            return _done(outs)

        return self._reduce(outputs, opts, "reduce_scatter_tensor_coalesced", run, cast=False)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # --- gathers into one tensor: any dtype, any world size -----------------------------------------------
    def all_gather_single(self, output, input, opts=None):
        return self._gloo._allgather_base(output, input, opts if opts is not None else dist.AllgatherOptions())

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
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
