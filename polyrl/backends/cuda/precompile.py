"""``precompile``: the cuda backend's ``Backend.precompile`` — compile the Triton attention kernels a run will launch
before its first step, several at a time.

Where Triton's cache is cold (a machine's or a container's first run) every kernel compiles at its first launch,
one after another, inside the first step: 34.1 s of the tiny DAPO recipe's 36.8 s first step on an H100
(docs/performance.md, "Triton's compiles"). The trainer hands the model's attention layouts to the backend before it
builds anything, and:

1. in the calling thread, each layout's forward and backward run on a few tokens with launches *recorded*, not
   made (polyrl.backends.cuda.launching, through which every attention launch goes): the same code as a real call
   builds the same arguments, so each recorded launch is the one a real call of that layout makes;
2. a pool of threads compiles the recorded launches with Triton's ``warmup`` (compile, no launch): the compiled
   kernel goes into the kernel's in-memory cache under the key the real call computes, and into Triton's on-disk
   cache. Triton's compiler spends its time in LLVM and ptxas, outside the GIL, so the compiles run side by side
   and beside the trainer's build;
3. the trainer waits for the pool before it builds the rollout engine (the first launches), and logs one line.

No device work leaves the calling thread: the workers only compile (they set the current device, which Triton reads
to pick its per-device cache). What the number of tokens does not change, one compile covers: the kernels take T as
a runtime value, and head dims that are multiples of 16 give every layout of q / k / v (contiguous or the packed
views transformers hands over) the same specialisation. A launch that still misses compiles at its call, as before.
``POLYRL_PRECOMPILE=0`` turns it off; ``POLYRL_PRECOMPILE_THREADS=N`` caps the threads (default: this rank's share
of the CPUs); under ``TRITON_INTERPRET=1`` there is nothing to compile. The log line names the slowest compile and
the sum of all, so that a run shows whether one kernel or the threads' contention bounds the wall.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from polyrl.backends.cuda.launching import recording

if TYPE_CHECKING:
    import torch

    from polyrl.core.attention.layouts import AttentionLayout

ENV = "POLYRL_PRECOMPILE"
THREADS_ENV = "POLYRL_PRECOMPILE_THREADS"
# the dtypes the Triton attention kernel runs (float64 goes to the reference)
KERNEL_DTYPES = ("float32", "bfloat16", "float16")
# tokens of the recording call: two documents, so that document bounds are exercised (any T compiles the same code)
RECORD_TOKENS = (24, 40)


def compile_jobs(kernel: Any, args: tuple, kwargs: dict) -> list[tuple[Any, dict]]:
    """The (JIT function, launch keyword arguments) pairs the launch ``kernel[grid](*args, **kwargs)`` compiles:
    the function itself, or under an autotuner the configs its ``run`` would take — the only one, unpruned, as
    Triton's ``Autotuner.run`` takes it, or every pruned candidate, which its benchmark would compile."""
    import triton

    if not isinstance(kernel, triton.runtime.Autotuner):
        return [(kernel, dict(kwargs))]
    if len(kernel.configs) == 1:
        configs = kernel.configs
    else:
        kernel.nargs = dict(zip(kernel.arg_names, args))
        try:
            configs = kernel.prune_configs(kwargs)
        finally:
            kernel.nargs = None
    return [(kernel.fn, {**kwargs, **c.all_kwargs()}) for c in configs]


def _signature(fn: Any, args: tuple, kwargs: dict) -> tuple:
    """What of a launch selects its compiled kernel, as Triton specialises (tensors: dtype and 16-byte alignment;
    integers: 1, divisible by 16; the keyword arguments), or finer: two launches with the same signature compile
    the same kernel, so it is compiled once (the backward's preprocess kernel is the same for several layouts)."""
    def one(a: Any) -> Any:
        if hasattr(a, "data_ptr"):
            return str(a.dtype), a.data_ptr() % 16 == 0
        if isinstance(a, bool) or not isinstance(a, int):
            return type(a).__name__ if isinstance(a, float) else a
        return a == 1, a % 16 == 0
    return id(fn), tuple(one(a) for a in args), tuple(sorted((k, str(v)) for k, v in kwargs.items()))


def thread_cap() -> int | None:
    """``POLYRL_PRECOMPILE_THREADS`` as a positive whole number, None where unset or empty; another value is refused
    in one line (``BadInputError``), before anything is recorded or compiled."""
    from polyrl.core.errors import BadInputError

    cap = os.environ.get(THREADS_ENV, "").strip()
    if not cap:
        return None
    if not cap.isdigit() or int(cap) < 1:
        raise BadInputError(f"{THREADS_ENV}={cap!r}: expected a whole number of threads, at least 1")
    return int(cap)


def _threads(jobs: int) -> int:
    """Compile threads: this process's share of the CPUs it may run on (the host's ranks compile side by side), or
    ``POLYRL_PRECOMPILE_THREADS`` where set; never more than the jobs."""
    cap = thread_cap()
    if cap is not None:
        return min(jobs, cap)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_rank = cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(jobs, per_rank))


def _record(layout: AttentionLayout, dtype: torch.dtype, device: torch.device) -> list[tuple[Any, Any, tuple, dict]]:
    """The launches one forward + backward of ``layout`` in ``dtype`` makes (recorded, none made); [] where the
    backend's rule runs FlashAttention-4 for it (its kernels are not Triton's)."""
    import torch

    from polyrl.backends.cuda.attention import KernelOptions, _VarlenAttention
    from polyrl.backends.cuda.attention_choice import choose

    T = sum(RECORD_TOKENS)
    q = torch.zeros(T, layout.q_heads, layout.head_dim, device=device, dtype=dtype)
    k = torch.zeros(T, layout.kv_heads, layout.head_dim, device=device, dtype=dtype)
    v = torch.zeros(T, layout.kv_heads, layout.v_head_dim, device=device, dtype=dtype)
    sinks = torch.zeros(layout.q_heads, device=device, dtype=dtype) if layout.sinks else None
    if choose(q, v, layout.window, sinks).kernel != "triton":
        return []
    cu = torch.tensor([0, RECORD_TOKENS[0], T], device=device, dtype=torch.int32)
    # The autograd Function's forward and backward called here, not through autograd: its engine runs a CUDA
    # backward on a thread of its own, where this thread's recording would not be seen (the launches made).
    ctx = _Context()
    with recording() as launches:
        out = _VarlenAttention.forward(ctx, q, k, v, cu, layout.head_dim ** -0.5, layout.window, sinks,
                                       KernelOptions.from_env())
        _VarlenAttention.backward(ctx, torch.zeros_like(out))
    return launches


class _Context:
    """What ``_VarlenAttention`` reads of autograd's ctx: saved tensors, its own fields, every input's gradient."""

    needs_input_grad = (True,) * 8

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors


def precompile(layouts: Sequence[AttentionLayout], dtypes: Sequence[torch.dtype],
               device: torch.device) -> Callable[[], str] | None:
    """Record the launches of ``layouts`` x ``dtypes`` (those the Triton kernel runs) and start compiling them on a
    thread pool; returns the function that waits for them and says what was compiled (module docstring). None
    where there is nothing to compile: turned off, the interpreter, not a CUDA device, no layout."""
    import torch

    from polyrl.backends.cuda.kernels.configs import interpreting

    if os.environ.get(ENV, "1") in ("0", "") or interpreting() or device.type != "cuda":
        return None
    from polyrl.core.plugins.kernels import one_line

    thread_cap()  # a bad value is refused before any work
    dtypes = [d for d in dict.fromkeys(dtypes) if str(d).removeprefix("torch.") in KERNEL_DTYPES]
    start = time.perf_counter()
    jobs: list[tuple[Any, tuple, dict, Any]] = []
    try:
        with torch.cuda.device(device):
            for dtype in dtypes:
                for layout in dict.fromkeys(layouts):
                    for kernel, grid, args, kwargs in _record(layout, dtype, device):
                        jobs.extend((fn, args, kw, grid) for fn, kw in compile_jobs(kernel, args, kwargs))
    except Exception as exc:  # never the run's end: the kernels compile at their first call, as without this
        reason = one_line(exc)
        return lambda: f"precompile: not done ({reason}); the kernels compile at their first call"
    jobs = list({_signature(fn, args, kw): (fn, args, kw, grid) for fn, args, kw, grid in jobs}.values())
    if not jobs:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    for fn in {id(fn): fn for fn, *_ in jobs}.values():
        fn.device_caches[index]  # created here, not raced into existence by two workers
    threads = _threads(len(jobs))
    pool = ThreadPoolExecutor(threads, thread_name_prefix="polyrl-precompile", initializer=torch.cuda.set_device,
                              initargs=(index,))
    took: list[tuple[float, float, str]] = []  # each compile's (end, own wall, kernel name)

    def compile_one(fn: Any, args: tuple, kwargs: dict, grid: Any) -> None:
        t0 = time.perf_counter()
        fn.warmup(*args, grid=grid, **kwargs)
        t1 = time.perf_counter()
        took.append((t1, t1 - t0, getattr(fn, "__name__", type(fn).__name__)))

    futures: list[Future] = [pool.submit(compile_one, *job) for job in jobs]
    pool.shutdown(wait=False)

    def wait() -> str:
        waited = time.perf_counter()
        failed = []
        for f in futures:
            try:
                f.result()
            except Exception as exc:  # compiled again, and raised there, at the kernel's first real call
                failed.append(one_line(exc))
        now = time.perf_counter()
        done = max((end for end, _, _ in took), default=now)
        line = (f"precompile: {len(jobs) - len(failed)} Triton attention kernels for {len(dict.fromkeys(layouts))} "
                f"layouts x {len(dtypes)} dtypes on {threads} threads in {done - start:.1f} s (the build waited "
                f"{now - waited:.1f} s)")
        if took:
            _, slow, name = max(took, key=lambda t: t[1])
            line += f"; slowest {name} {slow:.1f} s, all compiles together {sum(t[1] for t in took):.1f} s"
        if failed:
            line += f"; {len(failed)} failed (compiled at their first call instead): {failed[0]}"
        return line

    # a build that fails before it waits drops the compiles not started (the process's exit would wait for them)
    wait.cancel = lambda: pool.shutdown(wait=False, cancel_futures=True)  # type: ignore[attr-defined]
    return wait
