"""The rollout engine in the memory plan: what an engine with its own weights (vLLM) holds on a device.

The ``hf`` engine generates with the trainer's own model: the plan counts its KV cache and prefill logits
(polyrl.core.plan.memory). The ``vllm`` engine holds a copy of the weights of its own and takes a fixed fraction of
the device while awake (``gpu_memory_utilization``, from the backend's settings: 0.5 on cuda, 0.6 on ascend) —
its weights, KV cache and working memory all live inside that share, and vLLM (vllm-ascend too) refuses to start
when that much is not free beside the trainer's resident state. A backend that sizes the KV cache to the rollout
(``size_kv_cache``: the sequences one generate call holds x their longest length, the engine's
``kv_cache_bytes``) gives vLLM its weights, that cache and its working memory (``VLLM_WORKSPACE_GIB``) instead of
a share. Asleep (sleep level >= 1, during the update) it gives the device memory back. So for vLLM the plan
counts: the share during rollout, on top of the trainer's state; nothing during the update (at sleep level 0,
``rollout.sleep_level`` or the backend's, the share stays); and whether the engine's own weights (one full copy per
device at tensor parallel 1) leave room for the KV cache of one longest sequence inside the share — if not, vLLM
cannot start, whatever the rest of the device holds.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from polyrl.core.plugins.backend import Backend

GIB = 2**30
VLLM_DEFAULT_UTILIZATION = 0.9  # vLLM's own default gpu_memory_utilization
# What vLLM holds beside its weights and a sized KV cache: the activations of its profiling forward, the CUDA
# graphs' pools, the sampler's buffers (an estimate, checked against the measured GPT-OSS-20B run in docs/lora.md).
VLLM_WORKSPACE_GIB = 2.0
KV_BLOCK_TOKENS = 16  # vLLM's KV block on CUDA (the sized cache holds whole blocks)
WEIGHTS_ROW = "rollout engine weights (vllm)"
SHARE_ROW = "rollout engine (reserved)"  # the same row as for any engine with a share of its own


def sized_kv_cache_bytes(per_token: float, max_num_seqs: int, max_len: int, block_tokens: int = KV_BLOCK_TOKENS) -> int:
    """Bytes of KV cache for ``max_num_seqs`` sequences of up to ``max_len`` tokens at ``per_token`` bytes per
    token (every layer's), in whole blocks of ``block_tokens``, with a quarter more for the allocator's rounding
    and 64 MiB of floor: what the vllm engine gives vLLM (``kv_cache_memory_bytes``) and what the plan counts."""
    tokens = max_num_seqs * (-(-max_len // block_tokens) * block_tokens)
    return int(tokens * per_token * 1.25) + (64 << 20)


@dataclasses.dataclass
class EnginePlan:
    weights_gib: float  # the engine's own weights per device (inside its share)
    share_gib: float  # its share of the device while awake
    awake_gib: float  # what the engine holds on the device while it generates
    asleep_gib: float  # what it holds during the update
    problem: str  # why the engine itself cannot start ("" when it can)
    note: str


def vllm_plan(backend: Backend, *, params: int, dtype_bytes: int, capacity_gib: float,
              kv_bytes_per_token: list[tuple[str, float]], window: int | None, longest: int,
              rows: int | None = None, sleep_level: int | None = None) -> EnginePlan:
    """What the vllm engine holds per device: ``params`` weights in the model's dtype, divided by its tensor
    parallel size; its share of the device; and the check that weights + the KV cache of one ``longest``
    sequence fit in the share (vLLM refuses to start otherwise). ``rows``: the sequences one generate call holds
    (a backend with ``size_kv_cache`` sizes the cache to them); ``sleep_level``: ``rollout.sleep_level`` (None:
    the backend's)."""
    options = backend.engines.rollout_engine_options("vllm") or {}
    util = options.get("gpu_memory_utilization") or VLLM_DEFAULT_UTILIZATION
    tp = int((options.get("llm_kwargs") or {}).get("tensor_parallel_size", 1))
    if sleep_level is None:
        sleep_level = int(options.get("sleep_level", 0))
    weights = params * dtype_bytes / tp / GIB
    kv = sum(per * (min(longest, window) if kind == "sliding" and window else longest)
             for kind, per in kv_bytes_per_token) / tp / GIB
    share = util * capacity_gib
    sized = bool(options.get("size_kv_cache")) and bool(rows)
    if sized:  # as the engine sizes it (every layer counted full; its max_model_len is the longest + 1)
        every_layer = sum(per for _, per in kv_bytes_per_token)
        cache = sized_kv_cache_bytes(every_layer, rows, longest + 1,
                                     int(options.get("kv_block_tokens", KV_BLOCK_TOKENS))) / tp / GIB
        share = weights + cache + VLLM_WORKSPACE_GIB
    # the weights live inside the share: the share is what the phases count, the weights what the check reads
    problem = ""
    if weights + kv > share:
        problem = (f"the vllm engine's own weights ({weights:.1f} GiB at tensor parallel {tp}) and the KV cache of "
                   f"one {longest}-token sequence ({kv:.1f} GiB) exceed its share of the device ({share:.1f} GiB = "
                   f"{util:g} x {capacity_gib:g}, gpu_memory_utilization of backend {backend.name!r}): set "
                   "rollout.engine=hf (it generates with the trainer's own weights) or use devices with more memory "
                   "(vLLM tensor parallelism, which would divide the weights, is not in polyrl's engine yet)")
    held = (f"{share:.1f} GiB (its KV cache sized to {rows} sequences of {longest} tokens: {cache:.1f} GiB, "
            f"+ {VLLM_WORKSPACE_GIB:g} GiB of working memory)" if sized else f"{share:.1f} GiB ({util:g} of the device)")
    note = (f"rollout: vllm engine with its own weights ({weights:.1f} GiB, tensor parallel {tp}) inside "
            f"{held} while awake; " + (f"asleep (level {sleep_level}) during the update" if sleep_level
                                                else "it keeps its share during the update (no sleep)"))
    return EnginePlan(weights_gib=weights, share_gib=share, awake_gib=share, asleep_gib=0.0 if sleep_level else share, problem=problem,
                      note=note)
