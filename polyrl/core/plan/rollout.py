"""The rollout engine in the memory plan: what an engine with its own weights (vLLM) holds on a device.

The ``hf`` engine generates with the trainer's own model: the plan counts its KV cache and prefill logits
(polyrl.core.plan.memory). The ``vllm`` engine holds a copy of the weights of its own and takes a fixed fraction of
the device while awake (``gpu_memory_utilization``, from the backend's settings: 0.5 on cuda, 0.6 on ascend) —
its weights, KV cache and working memory all live inside that share, and vLLM (vllm-ascend too) refuses to start
when that much is not free beside the trainer's resident state. Asleep (sleep level >= 1, during the update) it
gives the device memory back. So for vLLM the plan counts: the share during rollout, on top of the trainer's
state; nothing during the update (at sleep level 0, the share stays); and whether the engine's own weights (one
full copy per device at tensor parallel 1) leave room for the KV cache of one longest sequence inside the share —
if not, vLLM cannot start, whatever the rest of the device holds.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from polyrl.core.plugins.backend import Backend

GIB = 2**30
VLLM_DEFAULT_UTILIZATION = 0.9  # vLLM's own default gpu_memory_utilization
WEIGHTS_ROW = "rollout engine weights (vllm)"
SHARE_ROW = "rollout engine (reserved)"  # the same row as for any engine with a share of its own


@dataclasses.dataclass
class EnginePlan:
    weights_gib: float  # the engine's own weights per device (inside its share)
    share_gib: float  # its share of the device while awake
    awake_gib: float  # what the engine holds on the device while it generates
    asleep_gib: float  # what it holds during the update
    problem: str  # why the engine itself cannot start ("" when it can)
    note: str


def vllm_plan(backend: Backend, *, params: int, dtype_bytes: int, capacity_gib: float,
              kv_bytes_per_token: list[tuple[str, float]], window: int | None, longest: int) -> EnginePlan:
    """What the vllm engine holds per device: ``params`` weights in the model's dtype, divided by its tensor
    parallel size; its share of the device; and the check that weights + the KV cache of one ``longest``
    sequence fit in the share (vLLM refuses to start otherwise)."""
    options = backend.engines.rollout_engine_options("vllm") or {}
    util = options.get("gpu_memory_utilization") or VLLM_DEFAULT_UTILIZATION
    tp = int((options.get("llm_kwargs") or {}).get("tensor_parallel_size", 1))
    sleep_level = int(options.get("sleep_level", 0))
    weights = params * dtype_bytes / tp / GIB
    kv = sum(per * (min(longest, window) if kind == "sliding" and window else longest)
             for kind, per in kv_bytes_per_token) / tp / GIB
    share = util * capacity_gib
    # the weights live inside the share: the share is what the phases count, the weights what the check reads
    problem = ""
    if weights + kv > share:
        problem = (f"the vllm engine's own weights ({weights:.1f} GiB at tensor parallel {tp}) and the KV cache of "
                   f"one {longest}-token sequence ({kv:.1f} GiB) exceed its share of the device ({share:.1f} GiB = "
                   f"{util:g} x {capacity_gib:g}, gpu_memory_utilization of backend {backend.name!r}): set "
                   "rollout.engine=hf (it generates with the trainer's own weights) or use devices with more memory "
                   "(vLLM tensor parallelism, which would divide the weights, is not in polyrl's engine yet)")
    note = (f"rollout: vllm engine with its own weights ({weights:.1f} GiB, tensor parallel {tp}) inside "
            f"{share:.1f} GiB ({util:g} of the device) while awake; " + (f"asleep (level {sleep_level}) during the update" if sleep_level
                                                else "it keeps its share during the update (no sleep)"))
    return EnginePlan(weights_gib=weights, share_gib=share, awake_gib=share, asleep_gib=0.0 if sleep_level else share, problem=problem,
                      note=note)
