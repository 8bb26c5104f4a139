"""HCCL's collective rules, and polyrl's collectives under them — on gloo, not on an NPU.

HCCL (torch_npu's ProcessGroupHCCL, before Ascend 950) reduces no float64, no bool, takes no ReduceOp.AVG, and its
all_gather_into_tensor / reduce_scatter_tensor refuse world sizes 3, 5, 6, 7. The emulated ascend backend
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


def _torchrun(scenario: str, nproc: int, out: Path) -> list[dict]:
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("POLYRL_ASCEND_ON_CPU", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(WORKER), scenario, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


# --- the rules, one process -------------------------------------------------------------------------------
def test_hccl_refuses_float64_bool_and_avg_with_its_own_words() -> None:
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

    with pytest.raises(RuntimeError, match=r"^Cannot use ReduceOp.AVG with HCCL"):
        hccl.check_reduce_op(dist.ReduceOp.AVG)
    hccl.check_reduce_op(dist.ReduceOp.SUM)


def test_the_ascend_backend_declares_what_hccl_reduces() -> None:
    ascend = get_registry().backends["ascend"]
    assert {getattr(torch, n) for n in ascend.collective_reduce_dtypes} == set(hccl.REDUCE_DTYPES)
    from polyrl.backends.ascend import HCCL_ALL_TO_ALL_DTYPES

    assert {getattr(torch, n) for n in HCCL_ALL_TO_ALL_DTYPES} == set(hccl.ALL_TO_ALL_DTYPES)
    assert ascend.sharding_policy().world_sizes_refused == hccl.WORLD_SIZES_REFUSED
    assert not get_registry().backends["cpu"].collective_reduce_dtypes  # gloo reduces every dtype


def test_three_emulated_processes_are_refused_before_any_starts(tmp_path) -> None:
    import os

    # a subprocess: --emulate puts the emulator in sys.modules, which must not leak into other tests
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("POLYRL_ASCEND_ON_CPU", None)
    proc = subprocess.run([sys.executable, "-m", "polyrl", "run", "gpt_oss_dapo_tiny", "--backend", "ascend",
                           "--emulate", "--nproc", "3", "--output", str(tmp_path / "run"), "data.batch_size=6"],
                          env=env, capture_output=True, text=True, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, err
    assert "world size 3" in err[0] and "HCCL's all_gather_into_tensor / reduce_scatter_tensor" in err[0]
    assert "3, 5, 6 and 7" in err[0]
    assert not (tmp_path / "run").exists()


# --- several processes ------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_emulated_ascend_group_refuses_what_hccl_refuses_and_polyrl_reduces_float64_exactly(tmp_path) -> None:
    ranks = _torchrun("emulated", 2, tmp_path)
    for seen in ranks:
        assert seen["backend"] == hccl.BACKEND_NAME
        assert seen["fp64"].startswith("HCCL allreduce: Unsupported data type at::kDouble")
        assert seen["bool"].startswith("HCCL allreduce: Unsupported data type at::kByte/at::kBool")
        assert seen["avg"].startswith("Cannot use ReduceOp.AVG with HCCL")
        for key, r in seen["reductions"].items():
            assert r["dtype"] == "torch.float64", key
            # two ranks: a + b is b + a, so the gather's sum is the float64 all-reduce's, bit for bit
            assert r["got"] == r["ref"], (key, r)
        assert seen["metrics"] == {"a": 1.5 + 2.5, "n": 10.0 + 20.0}
        a2a = seen["all_to_all"]  # bf16 rows: refused by HCCL's all-to-all, delivered exactly by the backend's
        for name in ("rows", "vector"):
            assert a2a[f"{name}/raw"].startswith("HCCL alltoall_base: Unsupported data type at::kBFloat16"), a2a
            assert a2a[f"{name}/exact"], name
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
def test_the_emulated_group_refuses_gathers_into_one_tensor_on_three_ranks(tmp_path) -> None:
    for seen in _torchrun("world", 3, tmp_path):
        assert seen["all_gather_into_tensor"].startswith("HCCL _allgather_base: world size 3 is not supported")
        assert seen["reduce_scatter_tensor"].startswith("HCCL _reduce_scatter_base: world size 3 is not supported")
        assert seen["all_gather"] == "accepted"  # the list form has no such rule
