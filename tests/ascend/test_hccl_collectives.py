"""HCCL's collective rules, and polyrl's collectives under them — on gloo, not on an NPU.

HCCL (torch_npu's ProcessGroupHCCL, before Ascend 950) reduces no float64, casts bool / uint8 to int32 in
all_reduce (and refuses them in reduce_scatter), runs ReduceOp.AVG as SUM then a division, refuses no world size,
and exchanges bf16 in all-to-all from torch_npu 2.8.0.post2 only (polyrl.emulation.hccl cites each rule's source).
The emulated ascend backend
(``--emulate``) opens a process group with those rules; polyrl's own collectives (float64 loss sums, token counts,
metrics) must still give the float64 numbers there: they travel through a gather, exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl.core.plugins import get_registry
from polyrl.emulation import hccl

WORKER = Path(__file__).with_name("hccl_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _torchrun(scenario: str, nproc: int, out: Path, version: str = "2.9.0") -> list[dict]:
    import os

    env = {**os.environ, "POLYRL_NPU_EMULATOR_VERSION": version, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("POLYRL_ASCEND_ON_CPU", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(WORKER), scenario, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


# --- the rules, one process -------------------------------------------------------------------------------
def test_hccl_refuses_float64_and_bitwise_ops_with_its_own_words() -> None:
    with pytest.raises(RuntimeError, match=r"^HCCL allreduce: Unsupported data type at::kDouble\n.*ERR02007 DIST "
                                           r"feature not supported"):
        hccl.check_dtype(torch.zeros(1, dtype=torch.float64), "allreduce")
    with pytest.raises(RuntimeError, match=r"^HCCL _reduce_scatter_base: Unsupported data type at::kByte/at::kBool"):
        hccl.check_dtype(torch.zeros(1, dtype=torch.bool), "_reduce_scatter_base")
    with pytest.raises(RuntimeError, match=r"^Unsupported data type for HCCL process group"):
        hccl.check_dtype(torch.zeros(1, dtype=torch.complex64), "allreduce")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8):
        hccl.check_dtype(torch.zeros(1, dtype=dtype), "allreduce")
    import torch.distributed as dist

    with pytest.raises(RuntimeError, match=r"^Cannot use ReduceOp.BAND with HCCL"):
        hccl.check_reduce_op(dist.ReduceOp.BAND)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX):  # AVG: SUM, then a division
        hccl.check_reduce_op(op)


def test_all_to_all_types_follow_the_emulated_release() -> None:
    from polyrl.emulation.npu import install_emulator

    for version, bf16 in (("2.8.0", False), ("2.8.0.post2", True), ("2.9.0", True), ("2.7.1", False)):
        with install_emulator(version):
            assert (torch.bfloat16 in hccl.all_to_all_dtypes()) is bf16, version
            if not bf16:
                with pytest.raises(RuntimeError, match="Unsupported data type at::kBFloat16"):
                    hccl.check_all_to_all_dtype(torch.zeros(1, dtype=torch.bfloat16), "alltoall_base")


def test_the_ascend_backend_declares_what_hccl_reduces_and_exchanges() -> None:
    from polyrl.backends.ascend import HCCL_ALL_TO_ALL_DTYPES, HCCL_ALL_TO_ALL_DTYPES_7_3, all_to_all_dtypes
    from polyrl.emulation.npu import install_emulator

    ascend = get_registry().backends["ascend"]
    assert {getattr(torch, n) for n in ascend.collective_reduce_dtypes} == set(hccl.REDUCE_DTYPES)
    assert {getattr(torch, n) for n in HCCL_ALL_TO_ALL_DTYPES} == set(hccl.ALL_TO_ALL_DTYPES_7_2)
    assert {getattr(torch, n) for n in HCCL_ALL_TO_ALL_DTYPES_7_3} == set(hccl.ALL_TO_ALL_DTYPES_7_3)
    for version in ("2.8.0", "2.8.0.post2", "2.10.0"):
        with install_emulator(version):
            assert {getattr(torch, n) for n in all_to_all_dtypes()} == set(hccl.all_to_all_dtypes()), version
    assert ascend.sharding_policy().world_sizes_refused == ()  # no source refuses a world size
    assert not get_registry().backends["cpu"].collective_reduce_dtypes  # gloo reduces every dtype


# --- several processes ------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize(("version", "bf16"), [("2.8.0", False), ("2.9.0", True)])
def test_emulated_ascend_group_follows_hccl_and_polyrl_reduces_float64_exactly(tmp_path, version, bf16) -> None:
    ranks = _torchrun("emulated", 2, tmp_path, version)
    for seen in ranks:
        assert seen["backend"] == hccl.BACKEND_NAME
        assert seen["fp64"].startswith("HCCL allreduce: Unsupported data type at::kDouble")
        assert seen["bool"] == "accepted" and seen["bool_value"] == [True, False]  # int32 copy, copied back
        assert seen["bool_reduce_scatter"].startswith("HCCL _reduce_scatter_base: Unsupported data type at::kByte")
        assert seen["avg"] == "accepted" and seen["avg_value"] == [1.5, 1.5]
        assert seen["band"].startswith("Cannot use ReduceOp.BAND with HCCL")
        for key, r in seen["reductions"].items():
            assert r["dtype"] == "torch.float64", key
            # two ranks: a + b is b + a, so the gather's sum is the float64 all-reduce's, bit for bit
            assert r["got"] == r["ref"], (key, r)
        assert seen["metrics"] == {"a": 1.5 + 2.5, "n": 10.0 + 20.0}
        a2a = seen["all_to_all"]  # bf16 rows: native from 2.8.0.post2, as bytes before; exact either way
        for name in ("rows", "vector", "empty"):
            if bf16:
                assert a2a[f"{name}/raw"] == "accepted", a2a
            else:
                assert a2a[f"{name}/raw"].startswith("HCCL alltoall_base: Unsupported data type at::kBFloat16"), a2a
            assert a2a[f"{name}/exact"], name
    assert ranks[0]["avg_reduce_scatter"] == [0.0, 1.5] and ranks[1]["avg_reduce_scatter"] == [3.0, 4.5]
    assert ranks[0]["all_to_all"]["empty/rows"] == [0, 0] and ranks[1]["all_to_all"]["empty/rows"] == [3, 3]
    assert ranks[0]["all_to_all"]["counts"] == [0, 10] and ranks[1]["all_to_all"]["counts"] == [1, 11]
    assert ranks[0]["reductions"] == ranks[1]["reductions"]
    assert ranks[0]["fsdp_grad_norm"] == ranks[1]["fsdp_grad_norm"] > 0


@pytest.mark.distributed
def test_the_gather_reduction_equals_gloos_float64_all_reduce(tmp_path) -> None:
    for seen in _torchrun("gloo", 2, tmp_path):
        for key, r in seen.items():
            assert r["gather"] == r["gloo"], (key, r)
        # what float32 could not carry (1e8 + a fraction) survives: the reduction is float64
        assert seen["large"]["gather"][0] == (1e8 + 0.123456789) + (1e8 + 0.123456789 * 2)


@pytest.mark.distributed
def test_the_emulated_group_takes_gathers_into_one_tensor_on_three_ranks(tmp_path) -> None:
    # an earlier emulator refused world sizes 3, 5, 6, 7 here; ProcessGroupHCCL.cpp has no such check
    for seen in _torchrun("world", 3, tmp_path):
        assert seen == {"all_gather_into_tensor": "accepted", "reduce_scatter_tensor": "accepted",
                        "all_gather": "accepted"}
