"""What a checkpoint holds of the trainer's state: the DCP groups (module, optimizer) and the per-rank extra state
(RNG states, LR schedulers, the trainer's own state), each from the trainer's state dict by key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from polyrl.core.run.checkpoint.rng import rng_state

if TYPE_CHECKING:
    from polyrl.core.plugins.backend import Backend

# Which state entries pair into one DCP (module, optimizer) group; the key names are the trainer's.
MODULE_GROUPS = (("model", "optimizer"), ("critic", "critic_optimizer"))
# Entries saved per rank with torch.save (anything with state_dict()/load_state_dict()).
EXTRA_KEYS = ("scheduler", "critic_scheduler", "trainer")


def dcp_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """{"model": ..., "optimizer": ..., "critic": ..., "critic_optimizer": ...} as DCP state dicts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out: dict[str, Any] = {}
    for module_key, optim_key in MODULE_GROUPS:
        module = state.get(module_key)
        if module is None:
            continue
        optim = state.get(optim_key)
        msd, osd = get_state_dict(module, optim if optim is not None else [])
        out[module_key] = msd
        if optim is not None:
            out[optim_key] = osd
    return out


def extra_state(state: Mapping[str, Any], backend: Backend | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"rng": rng_state(backend)}
    for key in EXTRA_KEYS:
        obj = state.get(key)
        if obj is not None:
            extra[key] = obj.state_dict()
    return extra
