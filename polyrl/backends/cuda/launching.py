"""``launch``: how the cuda backend's attention launches its Triton kernels — made, or recorded for compiling ahead
(polyrl.backends.cuda.precompile) while ``recording()`` is active in the calling thread."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

# The launches recorded instead of made, while ``recording()`` is active in this thread (None: launch).
_RECORDED: ContextVar[list[tuple[Any, Any, tuple, dict]] | None] = ContextVar("polyrl_precompile_recorded",
                                                                              default=None)


def launch(kernel: Any, grid: Any, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)``, or, while ``recording()``, the launch kept for compiling (not made)."""
    recorded = _RECORDED.get()
    if recorded is None:
        kernel[grid](*args, **kwargs)
    else:
        recorded.append((kernel, grid, args, kwargs))


@contextmanager
def recording():
    """Launches through ``launch`` in this thread are recorded, not made; yields the list they go into."""
    recorded: list[tuple[Any, Any, tuple, dict]] = []
    token = _RECORDED.set(recorded)
    try:
        yield recorded
    finally:
        _RECORDED.reset(token)
