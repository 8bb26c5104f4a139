"""The random generators a checkpoint restores: Python's, NumPy's, torch's host generator, and the device's default
generator (asked of the backend's placement part, restored only on a device of the same type)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polyrl.core.plugins.backend import Backend


def rng_state(backend: Backend | None = None) -> dict[str, Any]:
    """Every RNG the loop may draw from, in weights_only-loadable types (tensors, ints, lists).

    The device's default generator is asked of the backend and tagged with its device type: a checkpoint
    restores it only on a device of the same type (a CUDA generator state means nothing to an NPU)."""
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "torch": torch.get_rng_state(),
    }
    device_state = backend.placement.device_rng_state() if backend is not None else None
    if device_state is not None:
        state["device"] = {"type": backend.device_type, "state": device_state}
    return state


def set_rng_state(state: Mapping[str, Any], backend: Backend | None = None) -> None:
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    torch.set_rng_state(state["torch"])
    saved = state.get("device")
    if backend is not None and isinstance(saved, Mapping) and saved.get("type") == backend.device_type:
        backend.placement.set_device_rng_state(saved["state"])
