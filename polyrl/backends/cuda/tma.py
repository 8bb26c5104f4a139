"""Host side of the kernels' TMA (tensor memory accelerator) loads: which tensors qualify, and the global scratch
Triton needs for descriptors built inside a kernel (``tl.make_tensor_descriptor``).

A kernel variant that loads through descriptors (``TMA`` in the forward, dQ and dK/dV kernels; kernels/README.md)
runs only where a Hopper pick asks for it (kernels/configs.py, compute capability 9.x; the interpreter emulates
descriptors anywhere, for the CPU tests) and the tensors meet the hardware's rules: a 16-byte aligned base, 16-byte
multiples for every stride but the last, a unit last stride, and rows of at least 16 bytes. Anything else runs the
pointer-load code, which computes the same values.
"""

from __future__ import annotations

import torch
import triton
from triton.runtime import _allocation


def tma_loadable(*tensors: torch.Tensor) -> bool:
    """True when every tensor can be read through a TMA descriptor over its own shape and strides (and its rows, the
    box's inner dimension, span at least 16 bytes)."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or t.shape[-1] * size < 16:
            return False
        if any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Give Triton an allocator for kernel scratch (where in-kernel descriptors live) unless one is set already:
    a caller's own allocator (a profiler's, a memory pool's) is kept."""
    current = _allocation._allocator.get()
    if isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(_scratch)
