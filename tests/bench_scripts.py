"""The bench/ scripts as modules for tests (they are scripts, not a package), and a one-call timer that stands in
for ``triton.testing.do_bench`` where a test runs a benchmark's code on the CPU."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """A fresh module of ``bench/<name>.py`` (a test may patch its globals without touching another's copy)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def wall_ms(fn, **_kw) -> float:
    """``fn()`` once, its wall time in ms (do_bench's signature; its warm-up and repeats ignored)."""
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3
