"""Which Ascend chip the run is on, and what that changes for polyrl.

Two facts from Huawei's own sources (op-plugin ``FlashAttentionKernelNpuOpApi.cpp`` on master; torch_npu's FSDP2
support notes), neither checked on hardware here:

- On Ascend 950 (``SocVersion >= Ascend950``) ``npu_fusion_attention`` calls ``aclnnFlashAttentionScoreV4`` with
  an empty optional in the sink slot: the forward IGNORES ``sink=`` while the backward
  (``aclnnFlashAttentionScoreGradV4``) passes it. The native sink route would train on a sink-free forward with
  a sink-aware backward — wrong gradients, silently. polyrl takes the lse route there
  (polyrl.backends.ascend.attention.sink_mode).
- torch_npu marks FSDP2's ``fully_shard`` unsupported on Ascend 950DT: a sharded run there is refused up front
  with a message instead of failing inside the first all-gather.

The chip name comes from ``POLYRL_ASCEND_SOC`` when set (a user's override, and how tests pick a chip), else
from ``torch_npu.npu.get_device_name()`` — read only when ``torch_npu`` is already imported (the worker that
runs the model has imported it; ``polyrl backends`` and the launcher never import it for this).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from polyrl.core.errors import BadInputError

SOC_ENV = "POLYRL_ASCEND_SOC"
_ASCEND_950 = re.compile(r"^ascend\s*950", re.IGNORECASE)
_ASCEND_950DT = re.compile(r"^ascend\s*950\s*dt", re.IGNORECASE)


def soc_name(torch_npu: Any | None = None) -> str | None:
    """"Ascend910B3", "Ascend950DT", ...: the override, else the device's name, else None (unknown)."""
    forced = os.environ.get(SOC_ENV, "").strip()
    if forced:
        return forced
    module = torch_npu if torch_npu is not None else sys.modules.get("torch_npu")
    get_name = getattr(getattr(module, "npu", None), "get_device_name", None)
    if get_name is None:
        return None
    try:
        return str(get_name()) or None
    except Exception:  # no device visible, or an old helper with another signature: unknown chip
        return None


def is_ascend_950(name: str | None) -> bool:
    return bool(name) and _ASCEND_950.match(name) is not None


def is_ascend_950dt(name: str | None) -> bool:
    return bool(name) and _ASCEND_950DT.match(name) is not None


def check_fully_shard_supported(torch_npu: Any | None = None) -> None:
    """Refuse FSDP2 where torch_npu says ``fully_shard`` does not run (Ascend 950DT)."""
    name = soc_name(torch_npu)
    if is_ascend_950dt(name):
        raise BadInputError(
            f"backend 'ascend': FSDP2 (fully_shard) is not supported by torch_npu on {name}; "
            "run with --nproc 1"
        )
