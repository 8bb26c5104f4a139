"""polyrl.backends.cuda.precompile on the CPU (the interpreter; the compiles themselves: test_precompile_gpu.py):
every launch of a layout's forward and backward goes through ``launch`` and is recorded, not made, while recording;
an autotuned launch compiles what Triton's ``Autotuner.run`` would; nothing is started where nothing compiles."""

from __future__ import annotations

import collections
import contextlib
import re
import time

import pytest
import torch
import triton
import triton.language as tl

from polyrl.backends.cuda import launching as L
from polyrl.backends.cuda import precompile as P
from polyrl.core.attention.layouts import AttentionLayout
from polyrl.core.errors import BadInputError


class _Kernel:
    """Stands for a Triton kernel: ``kernel[grid](*args, **kwargs)`` is remembered."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def test_launch_launches_outside_recording_and_records_inside():
    kernel = _Kernel()
    L.launch(kernel, (2,), (1, 2), {"B": 4})
    assert kernel.calls == [((2,), (1, 2), {"B": 4})]
    with L.recording() as recorded:
        L.launch(kernel, (3,), (5,), {"B": 8})
    assert kernel.calls == [((2,), (1, 2), {"B": 4})]  # not made
    assert recorded == [(kernel, (3,), (5,), {"B": 8})]
    L.launch(kernel, (1,), (), {})  # recording is over
    assert len(kernel.calls) == 2


@triton.jit
def _copy(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N), mask=offs < N)


def test_compile_jobs_follow_what_the_autotuner_would_run():
    one = triton.Config({"BLOCK": 16}, num_warps=2, num_stages=1)
    tuner = triton.autotune(configs=[one], key=["N"])(_copy)
    (job,) = P.compile_jobs(tuner, (0, 0, 100), {})
    assert job[0] is tuner.fn and job[1] == one.all_kwargs()  # the only config, unpruned, as Autotuner.run takes it

    configs = [triton.Config({"BLOCK": b}, num_warps=4, num_stages=2) for b in (16, 32, 64)]
    seen = {}

    def prune(configs, named_args, **kwargs):
        seen.update(named_args)
        return [c for c in configs if c.kwargs["BLOCK"] <= named_args["N"]]

    tuner = triton.autotune(configs=configs, key=["N"], prune_configs_by={"early_config_prune": prune})(_copy)
    jobs = P.compile_jobs(tuner, ("x", "y", 40), {"extra": 1})
    assert [kw["BLOCK"] for _, kw in jobs] == [16, 32]  # every pruned candidate (its benchmark compiles each)
    assert all(kw["extra"] == 1 and kw["num_warps"] == 4 for _, kw in jobs)
    assert seen["N"] == 40 and tuner.nargs is None  # pruned on the launch's arguments, left as found

    assert P.compile_jobs(_copy, (1,), {"BLOCK": 8}) == [(_copy, {"BLOCK": 8})]  # a plain JIT function


@pytest.mark.parametrize("bwd, backward_kernels", [
    ("two_pass", {"bwd_preprocess_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"}),
    ("atomic", {"bwd_preprocess_kernel", "attn_bwd_fused_kernel"}),
])
@pytest.mark.parametrize("window", [None, 8])
def test_every_attention_launch_of_forward_and_backward_is_recorded(monkeypatch, bwd, backward_kernels, window):
    monkeypatch.setenv("POLYRL_ATTN_BWD", bwd)
    made = []
    real = L.launch

    def spy(kernel, grid, args, kwargs):  # what would be launched for real (none while recording)
        if L._RECORDED.get() is None:
            made.append(kernel)
        real(kernel, grid, args, kwargs)

    monkeypatch.setattr("polyrl.backends.cuda.attention.launch", spy)
    layout = AttentionLayout(4, 2, 32, 32, window, True)
    launches = P._record(layout, torch.float32, torch.device("cpu"))
    names = [_name(kernel) for kernel, *_ in launches]
    assert set(names) == {"attn_fwd_kernel"} | backward_kernels and len(names) == len(set(names)), names
    assert made == []
    for _, grid, args, kwargs in launches:  # each carries the real call's arguments
        assert callable(grid) or isinstance(grid, tuple)
        assert any(isinstance(a, torch.Tensor) for a in args) and kwargs


def _name(kernel) -> str:
    while not hasattr(kernel, "__name__") and hasattr(kernel, "fn"):
        kernel = kernel.fn
    return getattr(kernel, "__name__", None) or kernel.fn.__name__


def test_nothing_starts_where_nothing_compiles(monkeypatch):
    layouts = [AttentionLayout(4, 2, 32, 32)]
    assert P.precompile(layouts, [torch.float32], torch.device("cuda", 0)) is None  # the interpreter
    monkeypatch.setattr("polyrl.backends.cuda.kernels.configs.interpreting", lambda: False)
    assert P.precompile(layouts, [torch.float32], torch.device("cpu")) is None  # not a CUDA device
    monkeypatch.setenv(P.ENV, "0")
    assert P.precompile(layouts, [torch.float32], torch.device("cuda", 0)) is None  # turned off


def test_threads_are_this_ranks_share_of_the_cpus(monkeypatch):
    monkeypatch.setattr(P.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert P._threads(7) == 7 and P._threads(40) == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert P._threads(7) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert P._threads(7) == 1
    monkeypatch.setenv(P.THREADS_ENV, "3")
    assert P._threads(7) == 3 and P._threads(2) == 2
    for bad in ("many", "0", "-2", "1.5"):
        monkeypatch.setenv(P.THREADS_ENV, bad)
        with pytest.raises(BadInputError, match=f"POLYRL_PRECOMPILE_THREADS='{re.escape(bad)}': expected a whole"):
            P._threads(7)


def test_a_bad_thread_count_is_refused_before_any_recording(monkeypatch):
    monkeypatch.setattr("polyrl.backends.cuda.kernels.configs.interpreting", lambda: False)
    monkeypatch.setattr(P, "_record", lambda *a: pytest.fail("recorded before the thread count was checked"))
    monkeypatch.setenv(P.THREADS_ENV, "lots")
    with pytest.raises(BadInputError, match="POLYRL_PRECOMPILE_THREADS"):
        P.precompile([AttentionLayout(4, 2, 32, 32)], [torch.float32], torch.device("cuda", 0))


def test_launches_that_compile_the_same_kernel_are_one_job():
    x, y = torch.zeros(64), torch.zeros(64, dtype=torch.float16)
    same = P._signature(_copy, (x, x, 32), {"BLOCK": 16})
    assert P._signature(_copy, (x.clone(), x, 48), {"BLOCK": 16}) == same  # 32 and 48: both divisible by 16
    assert P._signature(_copy, (x, x, 33), {"BLOCK": 16}) != same
    assert P._signature(_copy, (x, x, 1), {"BLOCK": 16}) != P._signature(_copy, (x, x, 3), {"BLOCK": 16})
    assert P._signature(_copy, (y, x, 32), {"BLOCK": 16}) != same  # dtype
    assert P._signature(_copy, (x[1:], x, 32), {"BLOCK": 16}) != same  # alignment
    assert P._signature(_copy, (x, x, 32), {"BLOCK": 32}) != same
    assert P._signature(_copy, (x, x, 32.0), {"BLOCK": 16}) == P._signature(_copy, (x, x, 2.5), {"BLOCK": 16})


def test_a_recording_that_fails_ends_in_a_log_line_not_the_run(monkeypatch):
    monkeypatch.setattr("polyrl.backends.cuda.kernels.configs.interpreting", lambda: False)

    def broken(layout, dtype, device):
        raise RuntimeError("no kernel for this\nsecond line")

    monkeypatch.setattr(P, "_record", broken)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    wait = P.precompile([AttentionLayout(4, 2, 32, 32)], [torch.float32], torch.device("cuda", 0))
    assert wait() == "precompile: not done (RuntimeError: no kernel for this); the kernels compile at their first call"


class _SlowKernel:
    """A stand-in JIT function: ``warmup`` takes ``seconds`` (what Triton's compile would)."""

    def __init__(self, name, seconds):
        self.__name__, self.seconds, self.device_caches = name, seconds, collections.defaultdict(dict)

    def warmup(self, *args, grid, **kwargs):
        time.sleep(self.seconds)


def test_the_log_line_names_the_slowest_compile_and_the_sum(monkeypatch):
    monkeypatch.setattr("polyrl.backends.cuda.kernels.configs.interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setenv(P.THREADS_ENV, "2")
    fast, slow = _SlowKernel("fast_kernel", 0.05), _SlowKernel("slow_kernel", 0.3)
    monkeypatch.setattr(P, "_record", lambda layout, dtype, device: [(fast, (1,), (3,), {}), (slow, (1,), (5,), {})])
    wait = P.precompile([AttentionLayout(4, 2, 32, 32)], [torch.float32], torch.device("cuda", 0))
    line = wait()
    assert line.startswith("precompile: 2 Triton attention kernels for 1 layouts x 1 dtypes on 2 threads in ")
    slowest = re.search(r"slowest (\w+) ([\d.]+) s, all compiles together ([\d.]+) s$", line)
    assert slowest and slowest.group(1) == "slow_kernel", line
    assert float(slowest.group(2)) >= 0.29 and float(slowest.group(3)) >= 0.34, line
