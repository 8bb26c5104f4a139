"""Launch configurations of the attention kernels: Hopper candidates, a per-head-dim table, one safe set for the
interpreter.

Rows of a q tile are (token, head-of-the-group) pairs: ``BLOCK_M`` rows hold ``BLOCK_M // G_P`` tokens times
``G_P`` query heads (``G_P`` = Hq/Hkv rounded up to a power of two). One program therefore loads each K/V tile
once for the whole GQA group, which is what makes the 128-key window cheap.

Under ``TRITON_INTERPRET=1`` (CPU test suite) autotuning would run every candidate through the slow
interpreter; a single small config is used instead. ``triton.Config`` objects are plain data, building them
does not touch a device.
"""

from __future__ import annotations

import os

import triton


def interpreting() -> bool:
    """Triton reads TRITON_INTERPRET when @triton.jit decorates; this mirrors that decision."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def autotuning() -> bool:
    """Autotuning is opt-in (``POLYRL_TRITON_AUTOTUNE=1``): by default each kernel runs its first config, the
    one measured best on Hopper for the GPT-OSS/DeepSeek shape classes (docs/performance.md), so a process
    compiles each kernel once per shape class and, with Triton's on-disk cache, not at all after the first
    run on a machine. Tuned results are persisted too (``cache_results=True``: Triton's cache directory,
    keyed by the kernel source, the tuning key and the GPU), so tuning is paid once per machine, not per
    process."""
    return not interpreting() and os.environ.get("POLYRL_TRITON_AUTOTUNE", "0") not in ("", "0")


def _pick(configs: list[triton.Config]) -> list[triton.Config]:
    return configs if autotuning() else configs[:1]


def _cfg(num_warps: int, num_stages: int, **blocks: int) -> triton.Config:
    return triton.Config(blocks, num_warps=num_warps, num_stages=num_stages)


def forward_configs() -> list[triton.Config]:
    if interpreting():
        return [_cfg(4, 1, BLOCK_M=16, BLOCK_N=16)]
    # Hopper (sm_90): wgmma wants M a multiple of 64 per warpgroup; d64/d128 tiles stay in registers.
    return _pick([
        _cfg(4, 3, BLOCK_M=128, BLOCK_N=64),
        _cfg(8, 3, BLOCK_M=128, BLOCK_N=128),
        _cfg(8, 2, BLOCK_M=256, BLOCK_N=64),
        _cfg(4, 2, BLOCK_M=64, BLOCK_N=64),
        _cfg(8, 3, BLOCK_M=256, BLOCK_N=128),
        _cfg(4, 4, BLOCK_M=128, BLOCK_N=32),
    ])


def dq_configs() -> list[triton.Config]:
    if interpreting():
        return [_cfg(4, 1, BLOCK_M=16, BLOCK_N=16)]
    return _pick([
        _cfg(4, 2, BLOCK_M=128, BLOCK_N=64),
        _cfg(8, 2, BLOCK_M=128, BLOCK_N=128),
        _cfg(4, 3, BLOCK_M=64, BLOCK_N=64),
        _cfg(8, 3, BLOCK_M=256, BLOCK_N=64),
        _cfg(4, 3, BLOCK_M=128, BLOCK_N=32),
    ])


def dkdv_configs() -> list[triton.Config]:
    if interpreting():
        return [_cfg(4, 1, BLOCK_M=16, BLOCK_N=16)]
    # BLOCK_N keys of one kv head stay resident (dK, dV accumulators in fp32 registers); the loop walks
    # BLOCK_M rows = tokens x heads-of-the-group, so the group's dK/dV sum never leaves registers.
    return _pick([
        _cfg(4, 2, BLOCK_M=64, BLOCK_N=64),
        _cfg(8, 2, BLOCK_M=64, BLOCK_N=128),
        _cfg(8, 3, BLOCK_M=128, BLOCK_N=128),
        _cfg(4, 3, BLOCK_M=32, BLOCK_N=64),
        _cfg(8, 2, BLOCK_M=128, BLOCK_N=64),
        _cfg(4, 2, BLOCK_M=64, BLOCK_N=32),
    ])


def fused_configs() -> list[triton.Config]:
    if interpreting():
        return [_cfg(4, 1, BLOCK_M=16, BLOCK_N=16)]
    # The dK/dV kernel's candidates (same resident key tile, same row walk) plus smaller row tiles: the atomic
    # dQ product is one more (BLOCK_M, D) fp32 value live per step.
    return _pick([
        _cfg(4, 2, BLOCK_M=64, BLOCK_N=64),
        _cfg(8, 2, BLOCK_M=64, BLOCK_N=128),
        _cfg(4, 4, BLOCK_M=32, BLOCK_N=128),
        _cfg(4, 3, BLOCK_M=32, BLOCK_N=64),
        _cfg(8, 3, BLOCK_M=128, BLOCK_N=128),
    ])


# --- measured picks for the default path -----------------------------------------------------------------------
# Where bench/attention_sweep.py (each candidate of a kernel timed alone, outputs checked against the default's) found
# a clearly better config on Hopper, it replaces the first config of the kernel's list for that shape class only.
# Key: (kernel, head-dim class, has a window). Measured on one H100 (2026-12-06, c178864; GPT-OSS heads: 64 q / 8 kv,
# d 64, causal with sinks): dQ with BLOCK_M 256, BLOCK_N 64, 8 warps, 3 stages took 1.740 ms against 1.990 at
# 4 x 4096 tokens and 6.672 against 7.264 at 1 x 16384. Not measured, so unchanged: windows (the band path),
# head dims above 64 (a 256-row dQ tile would not fit the registers at 256), the forward kernel (its default was
# within 3% of the best), GPUs other than compute capability 9.x.
# dK/dV, measured on one H200 (2026-12-07, 97987a2, same shapes): 128 resident keys, 64 rows, 8 warps and one stage
# (no cp.async pipeline: 219 registers, no spills, where two stages take 228 and three spill) took 3.926 ms against
# the 64-key default's 4.086 at 4 x 4096 and 12.894 against 14.724 at 1 x 16384 (0.96x / 0.88x); the same tile
# with two stages was 1.15x / 1.06x slower than the default.
# Since d9f1fea the dK/dV pick is 64 rows, 64 keys, 4 warps, one stage with PREFETCH (the next q tile's loads issued
# before this tile's matmuls, so the one-stage walk stops waiting on each load): on one H100 (2026-12-07) 3.467 ms
# against the one above's 3.856 at 4 x 4096 and 11.908 against 12.603 at 1 x 16384 (0.90x / 0.94x).
# The forward, measured on one H100 (2026-12-07, 913204d): 128 rows, 64 keys, 8 warps, 3 stages with its K/V tiles
# loaded through TMA took 1.376 ms against the first config's 1.481 at 4 x 4096 and 4.986 against 5.421 at 1 x 16384
# (0.93x / 0.92x); TMA did not beat the dQ and dK/dV picks (bench/results/h100_2026-12-07_round44/sweep.log).
# A row may add the kernel's variant flags as a fifth element (constexprs, e.g. ``{"PREFETCH": True}``); a ``TMA``
# row runs with pointer loads where the tensors do not qualify (polyrl.backends.cuda.tma).
HOPPER_PICKS: dict[tuple[str, int, bool], tuple[int, int, int, int] | tuple[int, int, int, int, dict[str, bool]]] = {
    # (BLOCK_M, BLOCK_N, num_warps, num_stages[, variant flags])
    ("fwd", 64, False): (128, 64, 8, 3, {"TMA": True}),
    ("dq", 64, False): (256, 64, 8, 3),
    ("dkdv", 64, False): (64, 64, 4, 1, {"PREFETCH": True}),
}


def measured_pick(kernel: str, d: int, dv: int, has_window: bool, capability: tuple[int, int]) -> triton.Config | None:
    """The HOPPER_PICKS config of this launch, or None to run the kernel's first config (no entry, another GPU,
    the interpreter, or autotuning on: the autotuner then searches the whole list)."""
    if interpreting() or autotuning() or capability[0] != 9:
        return None
    row = HOPPER_PICKS.get((kernel, head_dim_class(d, dv), bool(has_window)))
    if row is None:
        return None
    m, n, w, s, *flags = row
    return _cfg(w, s, BLOCK_M=m, BLOCK_N=n, **(flags[0] if flags else {}))


# --- the per-head-dim table (``configs="table"`` in polyrl.backends.cuda.attention) ------------------------
# One entry per (kernel, head-dim class, window band): the first config is the table's pick, the rest are what
# ``POLYRL_TRITON_AUTOTUNE=1`` searches. Head-dim class = next power of two of max(D, Dv), clamped to 64..256.
# Why these shapes (sm_90, 228 KB shared memory, 64K registers per SM, wgmma M = 64 per warpgroup):
# - fwd: the q tile (BLOCK_M rows) stays in registers, K/V tiles stream through shared memory. d64 affords
#   BLOCK_N = 128 with 8 warps (the fp32 S tile is 128 x 128 over 256 threads: 64 registers a thread), which
#   halves the online-softmax rescales of BLOCK_N = 64; d128 keeps BLOCK_N = 64 to leave registers for O.
# - dkdv / fused: BLOCK_N keys resident (K, V, dK, dV), BLOCK_M rows streamed; few rows per step and deep
#   pipelining (small M tiles, 3-5 stages) is what FlashAttention-2-style Triton backwards settle on on Hopper.
# - dq: the mirror image: BLOCK_M rows resident, keys streamed.
# - band (window <= 256 with exact band bounds): one masked loop over W + BLOCK_M/G_P - 1 keys. BLOCK_N = 64
#   visits 3 key tiles per 16-token q tile (192 keys for 143 needed); BLOCK_N = 128 visits 2 (256). A 32-token
#   tile (BLOCK_M = 256 at G_P = 8) still needs 3 tiles of 64 (159 keys) but loads each K/V tile for twice
#   the rows, hence the forward's pick.
# None of these is measured yet: bench/attention.py --impls polyrl-table compares them with the first-config
# default in the same run, and POLYRL_TRITON_AUTOTUNE=1 (which searches each entry) prints what it picked.
_TABLE: dict[tuple[str, int, bool], list[tuple[int, int, int, int]]] = {
    # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    ("fwd", 64, False): [(128, 128, 8, 3), (128, 64, 4, 3), (256, 64, 8, 3), (128, 128, 4, 3), (64, 128, 4, 4)],
    ("fwd", 128, False): [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3)],
    ("fwd", 256, False): [(64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 3)],
    ("fwd", 64, True): [(256, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
    ("fwd", 128, True): [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
    ("fwd", 256, True): [(64, 64, 4, 2), (128, 32, 8, 2)],
    ("dq", 64, False): [(128, 64, 8, 3), (128, 32, 4, 4), (128, 64, 4, 2), (64, 64, 4, 3)],
    ("dq", 128, False): [(128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)],
    ("dq", 256, False): [(64, 32, 4, 2), (64, 64, 8, 2)],
    ("dq", 64, True): [(128, 64, 4, 3), (128, 32, 4, 4), (128, 128, 8, 2)],
    ("dq", 128, True): [(128, 64, 8, 3), (64, 64, 4, 3)],
    ("dq", 256, True): [(64, 32, 4, 2), (64, 64, 8, 2)],
    ("dkdv", 64, False): [(64, 128, 8, 3), (32, 128, 4, 5), (64, 64, 4, 3), (128, 128, 8, 2)],
    ("dkdv", 128, False): [(32, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3)],
    ("dkdv", 256, False): [(32, 64, 4, 2), (64, 64, 8, 2)],
    ("dkdv", 64, True): [(64, 64, 4, 3), (64, 128, 8, 3), (32, 64, 4, 4)],
    ("dkdv", 128, True): [(64, 64, 8, 3), (32, 128, 8, 3)],
    ("dkdv", 256, True): [(32, 64, 4, 2), (64, 64, 8, 2)],
    # fused dK/dV + atomic dQ: the dkdv shapes, one more live (M, D) fp32 product per step for the atomics.
    ("fused", 64, False): [(64, 128, 8, 3), (32, 128, 4, 4), (64, 64, 4, 3), (128, 128, 8, 2)],
    ("fused", 128, False): [(32, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 2)],
    ("fused", 256, False): [(32, 64, 4, 2), (64, 64, 8, 2)],
    ("fused", 64, True): [(64, 64, 4, 3), (64, 128, 8, 3), (32, 64, 4, 4)],
    ("fused", 128, True): [(64, 64, 8, 3), (32, 128, 8, 3)],
    ("fused", 256, True): [(32, 64, 4, 2), (64, 64, 8, 2)],
}
KERNELS = ("fwd", "dq", "dkdv", "fused")


def head_dim_class(d: int, dv: int) -> int:
    """64, 128 or 256: the table row of a (D, Dv) pair (D = 192 runs padded to 256, kernels/README.md)."""
    return min(max(triton.next_power_of_2(max(d, dv)), 64), 256)


def table_configs(kernel: str, d: int, dv: int, band: bool) -> list[triton.Config]:
    """The table's candidates for one kernel and shape class, its pick first; one small config when interpreting.

    Without ``POLYRL_TRITON_AUTOTUNE=1`` only the pick is returned (one compile, no benchmarking at launch)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; known: {', '.join(KERNELS)}")
    if interpreting():
        return [_cfg(4, 1, BLOCK_M=16, BLOCK_N=16)]
    rows = _TABLE[(kernel, head_dim_class(d, dv), band)]
    return _pick([_cfg(w, s, BLOCK_M=m, BLOCK_N=n) for m, n, w, s in rows])
