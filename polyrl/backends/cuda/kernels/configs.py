"""Launch configurations of the attention kernels: Hopper-tuned candidates, one safe set for the interpreter.

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
