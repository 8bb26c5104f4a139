"""The ascend backend's settings for the vllm rollout engine (polyrl.backends.vllm_engine), per vllm-ascend release.

vllm-ascend as its sources are at each tag (polyrl.backends.ascend.compat.VLLM_ASCEND_RELEASES), none of it run
here (no NPU; tests/ascend runs the engine against stand-ins of each release's worker and allocator):

- sleep mode (``enable_sleep_mode``, level 1: the only level vllm-ascend supports for RL) allocates through
  ``CaMemAllocator``, whose constructor asserts ``expandable_segments:True`` is absent from
  ``PYTORCH_NPU_ALLOC_CONF``: the engine refuses such an environment in one line, and the backend leaves that
  allocator setting out of its own defaults wherever vllm-ascend is installed (AscendBackend.sharding_policy);
- ``NPUWorker.reload_weights`` exists from v0.24.0rc1: before it, the engine syncs through the model's own
  ``load_weights`` on each worker (the engine finds out on the live workers, ``weight_loader="auto"``);
- GPT-OSS's attention sinks are served from v0.15.0rc1: v0.13 is refused for GPT-OSS;
- its sliding-window attention passes ``pre_tokens = sliding_window`` (W + 1 keys): the engine is told W - 1;
- no NZ (fractal) weight layout (``VLLM_ASCEND_ENABLE_NZ=0``): in-place weight updates write plain tensors; the
  engine core in-process; 60% of device memory, so that the trainer's shards fit beside it (the dry-run plan
  counts the engine's own weights, polyrl.core.plan).
"""

from __future__ import annotations

from typing import Any

from polyrl.backends.ascend.compat import vllm_ascend_model_problem, vllm_ascend_release

SLEEP_LEVEL = 1
GPU_MEMORY_UTILIZATION = 0.6
# CaMemAllocator.__init__ (vllm_ascend/device_allocator/camem.py, every tag): assert "expandable_segments:True"
# not in PYTORCH_NPU_ALLOC_CONF.
SLEEP_REFUSES_ENV = {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}
MODEL_TYPES = ("gpt_oss", "deepseek_v3", "llama", "qwen2", "qwen3")


def vllm_options(version: str | None) -> dict[str, Any]:
    """``VllmSettings`` fields for vllm-ascend ``version`` (None: not installed, the release-independent ones)."""
    options: dict[str, Any] = {
        "env": {"VLLM_ASCEND_ENABLE_NZ": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
        "sleep_level": SLEEP_LEVEL,
        "sleep_refuses_env": dict(SLEEP_REFUSES_ENV),
    }
    if version is None:
        return options
    _, release = vllm_ascend_release(version)
    refused = {m: p for m in MODEL_TYPES if (p := vllm_ascend_model_problem(version, m))}
    if refused:
        options["refused_models"] = refused
    if release.pre_tokens_is_sliding_window:
        options["sliding_window_offset"] = -1
    return options
