"""The ascend backend's guards for a first run on hardware, exercised against the strict emulator (nothing here
ran on an NPU): calls cut beyond the op's limits give the same result as one call, Ascend 950 takes the lse
route, 950DT refuses FSDP2, FSDP2's recent methods are feature-detected, sequence ends are read once per
micro-batch, and CPU mode / --emulate select the backend's real code."""

from __future__ import annotations

import itertools

import pytest
import torch

from polyrl.backends.ascend import ON_CPU_ENV, AscendBackend
from polyrl.backends.ascend import attention as npu_attention
from polyrl.backends.ascend.attention import SINK_ENV, detect_sink_mode, split_calls
from polyrl.backends.ascend.chip import SOC_ENV
from polyrl.core.attention import varlen_attention
from polyrl.core.config.schema import ShardingConfig
from polyrl.core.errors import BadInputError
from polyrl.core.tolerances import check_close
from polyrl.emulation import npu as npu_emulator
from polyrl.emulation.npu import emulated_ascend_backend, install_emulator


def _case(lens, hq=2, hkv=1, d=8, dv=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    q, k = torch.randn(t, hq, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    v = torch.randn(t, hkv, dv or d, generator=gen)
    return (q, k, v), cu, torch.randn(hq, generator=gen), torch.randn(t, hq, dv or d, generator=gen)


def _run(backend, inputs, cu, sinks, d_out, window=3):
    leaves = [x.clone().requires_grad_() for x in inputs]
    s = sinks.clone().requires_grad_()
    out = varlen_attention(*leaves, cu, window=window, sinks=s, backend=backend)
    out.backward(d_out)
    return [out, *(x.grad for x in leaves), s.grad]


def _all_close(got, expected, dtype=torch.float32):
    return all(check_close("attention.forward" if i == 0 else "attention.grad", a, e, dtype)[2]
               for i, (a, e) in enumerate(zip(got, expected)))


# --- the 1024-sequence limit ------------------------------------------------------------------------
def test_split_calls_respects_both_limits():
    ends = list(itertools.accumulate([2] * 7))
    calls = split_calls(ends, max_seqs=3, max_tokens=100)
    assert [(a, b, len(e)) for a, b, e in calls] == [(0, 6, 3), (6, 12, 3), (12, 14, 1)]
    assert all(e[-1] == b - a for a, b, e in calls)
    assert [len(e) for *_, e in split_calls(ends, max_seqs=100, max_tokens=5)] == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="exceeds the op's limit"):
        split_calls([3, 10], max_tokens=5)
    assert [len(e) for *_, e in split_calls(list(range(1, 1041)))] == [1024, 16]  # the op's own limit




@pytest.mark.parametrize("mode", ["native", "lse"])
def test_more_than_1024_sequences_are_cut_and_match_one_call(monkeypatch, mode):
    monkeypatch.setenv(SINK_ENV, mode)
    # The rule at a size a test can afford: an op that takes 8 sequences per call, 21 sequences packed.
    monkeypatch.setattr(npu_emulator, "MAX_SEQS", 8)
    monkeypatch.setattr(npu_attention, "MAX_SEQS_PER_CALL", 8)
    inputs, cu, s, d_out = _case([1, 2, 1, 3] * 5 + [2])
    with install_emulator() as emu:
        cut = _run(emulated_ascend_backend(), inputs, cu, s, d_out)
        assert len([c for c in emu.calls if c["op"] == "npu_fusion_attention"]) == 3
        monkeypatch.setattr(npu_emulator, "MAX_SEQS", 4096)  # an op without the limit: one call
        monkeypatch.setattr(npu_attention, "MAX_SEQS_PER_CALL", 4096)
        emu.calls.clear()
        whole = _run(emulated_ascend_backend(), inputs, cu, s, d_out)
        assert len([c for c in emu.calls if c["op"] == "npu_fusion_attention"]) == 1
    assert _all_close(cut, whole)


def test_more_than_256_query_heads_are_cut_by_kv_groups(monkeypatch):
    monkeypatch.setenv(SINK_ENV, "lse")
    inputs, cu, s, d_out = _case([3, 4], hq=512, hkv=4, d=4)
    expected = _run("cpu", inputs, cu, s, d_out)
    with install_emulator() as emu:
        got = _run(emulated_ascend_backend(), inputs, cu, s, d_out)
        assert {c["head_num"] for c in emu.calls if c["op"] == "npu_fusion_attention"} == {256}
    assert _all_close(got, expected)


def test_dk_smaller_than_dv_is_padded():
    inputs, cu, s, d_out = _case([3, 5], d=8, dv=16)
    with install_emulator():
        assert _all_close(_run(emulated_ascend_backend(), inputs, cu, s, d_out), _run("cpu", inputs, cu, s, d_out))


def test_shapes_no_reroute_can_fix_are_refused_with_the_limit():
    inputs, cu, s, _ = _case([2], d=800)
    with install_emulator(), pytest.raises(ValueError, match="head dims up to 768"):
        varlen_attention(*inputs, cu, sinks=s, backend=emulated_ascend_backend())


def test_float32_on_an_old_cann_is_refused_with_what_to_change():
    inputs, cu, _, _ = _case([2, 2])
    with install_emulator("2.6.0", cann_version="8.1.RC1"), pytest.raises(ValueError, match=r"model\.dtype"):
        varlen_attention(*inputs, cu, backend=emulated_ascend_backend())


# --- statistics layout and sequence ends ------------------------------------------------------------
@pytest.mark.parametrize(("version", "cann"), [("2.9.0", "8.5.0"), ("2.8.0", "8.3.RC1"), ("2.7.1", "8.3.RC1")])
def test_lse_route_asks_for_token_order_statistics(monkeypatch, version, cann):
    monkeypatch.setenv(SINK_ENV, "lse")
    inputs, cu, s, d_out = _case([1, 6, 2], hq=4, hkv=2)
    with install_emulator(version, cann_version=cann) as emu:
        got = _run(emulated_ascend_backend(), inputs, cu, s, d_out)
        assert {c["softmax_layout"] for c in emu.calls} == {"TND"}
    assert _all_close(got, _run("cpu", inputs, cu, s, d_out))


@pytest.mark.parametrize(("version", "cann"), [("2.6.0", "8.2.RC1"), ("2.8.0", "8.2.RC1"), ("2.7.0", "8.3.RC1")])
def test_lse_route_without_the_token_order_layout_is_refused(monkeypatch, version, cann):
    """The default layout is documented only as "NTD": polyrl does not guess it (an earlier release reordered
    per-sequence blocks, a layout read from the kernel, never from the documentation)."""
    monkeypatch.setenv(SINK_ENV, "lse")
    inputs, cu, s, _ = _case([1, 6, 2], hq=4, hkv=2)
    with install_emulator(version, cann_version=cann), pytest.raises(ValueError, match=r'softmax_layout="TND"'):
        varlen_attention(*inputs, cu, sinks=s, backend=emulated_ascend_backend())
    with install_emulator(version, cann_version=cann):  # without sinks no route is needed
        varlen_attention(*[x.half() for x in inputs], cu, backend=emulated_ascend_backend())


def test_sequence_ends_are_read_from_cu_seqlens_once_per_micro_batch(monkeypatch):
    inputs, cu, s, _ = _case([2, 3])
    reads = []
    original = torch.Tensor.tolist

    def counting(self):
        if self is cu:
            reads.append(1)
        return original(self)

    with install_emulator():
        backend = emulated_ascend_backend()
        monkeypatch.setattr(torch.Tensor, "tolist", counting)
        for _ in range(4):  # four layers of one forward: the same cu_seqlens object
            backend.varlen_attention(*inputs, cu, scale=0.3, window=None, sinks=s)
        assert len(reads) == 1
        cu.add_(0)  # modified in place: read again
        backend.varlen_attention(*inputs, cu, scale=0.3, window=None, sinks=s)
        assert len(reads) == 2


# --- chips -------------------------------------------------------------------------------------------
def test_ascend_950_takes_the_lse_route_and_forcing_native_there_is_wrong(monkeypatch):
    monkeypatch.delenv(SINK_ENV, raising=False)
    inputs, cu, s, d_out = _case([4, 5], hq=4, hkv=2)
    expected = _run("cpu", inputs, cu, s, d_out)
    with install_emulator("2.9.0.post2", soc_version="Ascend950PR") as emu:  # op-plugin 26.0.0: its 950 path
        mode, reason = detect_sink_mode(emu.module)
        assert mode == "lse" and "950" in reason
        assert _all_close(_run(emulated_ascend_backend(), inputs, cu, s, d_out), expected)
        monkeypatch.setenv(SINK_ENV, "native")  # what polyrl would pick by version alone
        assert not _all_close(_run(emulated_ascend_backend(), inputs, cu, s, d_out), expected)
    with install_emulator("2.9.0", soc_version="Ascend910B3") as emu:
        assert detect_sink_mode(emu.module)[0] == "native"


def test_fully_shard_is_refused_on_950dt(monkeypatch):
    monkeypatch.setenv(SOC_ENV, "Ascend950DT")
    with pytest.raises(BadInputError, match="not supported by torch_npu on Ascend950DT"):
        AscendBackend().check_world_size(2)
    AscendBackend().check_world_size(1)  # one process is not sharded
    monkeypatch.setenv(SOC_ENV, "Ascend950PR")
    AscendBackend().check_world_size(2)


def test_expert_parallel_layouts_hccl_takes_are_not_refused():
    """HCCL refuses no world size (ProcessGroupHCCL.cpp@v7.3.0-pytorch2.8.0: _allgather_base / _reduce_scatter_base
    check tensor sizes only): 6 NPUs, or world 12 with ep 2, are valid layouts."""
    from polyrl.core.distributed.sharding import check_sharding

    for world, ep in ((12, 2), (12, 4), (24, 8), (10, 2), (12, 3), (6, 1), (6, 2), (8, 2), (16, 16)):
        check_sharding(AscendBackend(), world, ShardingConfig(expert_parallel=ep))


def test_group_sizes_a_backend_refuses_are_refused_before_launch():
    """The mechanism (ShardingPolicy.world_sizes_refused) with a planted backend whose library refuses 3, 5, 6, 7."""
    import dataclasses

    from polyrl.backends.cpu import CpuBackend
    from polyrl.core.distributed.sharding import check_sharding

    class Refusing(AscendBackend):
        def sharding_policy(self):
            return dataclasses.replace(super().sharding_policy(), world_sizes_refused=(3, 5, 6, 7),
                                       world_size_rule="the planted library refuses world sizes 3, 5, 6 and 7")

    for world, ep in ((12, 2), (12, 4), (24, 8), (10, 2), (12, 3)):  # world / ep or ep is 3, 5, 6 or 7
        with pytest.raises(BadInputError, match=f"sharding.expert_parallel={ep} on {world} processes.*refuses"):
            check_sharding(Refusing(), world, ShardingConfig(expert_parallel=ep))
        check_sharding(CpuBackend(), world, ShardingConfig(expert_parallel=ep))  # gloo has no such rule
    for world, ep in ((8, 2), (16, 16), (256, 16), (16, 4)):
        check_sharding(Refusing(), world, ShardingConfig(expert_parallel=ep))


# --- FSDP2 feature detection -------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["set_gradient_divide_factor", "set_force_sum_reduction_for_comms"])
def test_fsdp2_methods_are_feature_detected(monkeypatch, method):
    from torch.distributed.fsdp import FSDPModule

    from polyrl.backends.cpu import CpuBackend
    from polyrl.core.distributed.sharding import check_sharding

    check_sharding(CpuBackend(), 2, ShardingConfig())
    monkeypatch.delattr(FSDPModule, method)
    with pytest.raises(BadInputError, match=f"FSDP2 has no {method}.*--nproc 1"):
        check_sharding(CpuBackend(), 2, ShardingConfig())
    check_sharding(CpuBackend(), 1, ShardingConfig())  # a single process does not shard


# --- CPU mode ----------------------------------------------------------------------------------------
def test_cpu_mode_is_the_real_backend_on_the_host(monkeypatch):
    monkeypatch.delenv(ON_CPU_ENV, raising=False)
    backend = AscendBackend()
    assert (backend.device_type, backend.collective_backend) == ("npu", "hccl")
    monkeypatch.setenv(ON_CPU_ENV, "1")
    monkeypatch.delitem(__import__("sys").modules, "torch_npu", raising=False)
    assert not backend.detect().available  # no stand-in importable
    with install_emulator():
        assert backend.detect().available and "not an NPU" in backend.detect().reason
        # gloo behind HCCL's rules (polyrl.emulation.hccl)
        assert (backend.device_type, backend.collective_backend, backend.device(3)) == ("cpu", "hccl_emulated",
                                                                                          torch.device("cpu"))
