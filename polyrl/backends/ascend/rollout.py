"""The ascend backend's settings for the vllm rollout engine (polyrl.backends.vllm_engine), per vllm-ascend release.

vllm-ascend as its sources are at each tag (polyrl.backends.ascend.compat.VLLM_ASCEND_RELEASES), none of it run
here (no NPU; tests/ascend runs the engine against stand-ins of each release's worker and allocator):

- sleep mode (``enable_sleep_mode``, level 1: the only level vllm-ascend supports for RL) allocates through
  ``CaMemAllocator``, whose constructor asserts ``expandable_segments:True`` is absent from
  ``PYTORCH_NPU_ALLOC_CONF``: the engine refuses such an environment in one line, and the backend leaves that
  allocator setting out of its own defaults wherever vllm-ascend is installed (AscendBackend.sharding_policy);
- ``NPUWorker.reload_weights`` exists from v0.24.0rc1 only, and is vLLM's layerwise reload, which drops the
  writes GPT-OSS makes without a ``weight_loader`` (experts, sinks): every release syncs through the model's own
  ``load_weights`` on each worker, then vLLM's post-load processing once (``weight_loader="load_weights"``: the
  path of vllm-ascend's own ``examples/offline_weight_load.py``);
- GPT-OSS's attention sinks are served from v0.15.0rc1: v0.13 is refused for GPT-OSS;
- its sliding-window attention passes ``pre_tokens = sliding_window`` (W + 1 keys): the engine is told W - 1;
- its sampler returns raw log-probs (before the temperature) whatever ``logprobs_mode`` asks
  (``vllm_ascend/sample/sampler.py``: ``AscendSampler`` defaults to ``raw_logprobs``, "TODO: support
  logprobs_mode in vllm-ascend"): ``raw_logprobs_only``, so an engine for a temperature != 1 is refused;
- its fused attention ops take float16 / bfloat16 only: an fp32 trainer's engine runs in bfloat16
  (``VllmSettings.dtypes``), a supported setting probed at bfloat16's bar;
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
# npu_fusion_attention and npu_fused_infer_attention_score (the prefill and decode attention of every tag) take
# float16 / bfloat16 only: an fp32 trainer's engine runs in bfloat16 (its probe bar is bfloat16's).
ENGINE_DTYPES = ("bfloat16", "float16")
MODEL_TYPES = ("gpt_oss", "deepseek_v3", "llama", "qwen2", "qwen3")


def vllm_options(version: str | None) -> dict[str, Any]:
    """``VllmSettings`` fields for vllm-ascend ``version`` (None: not installed, the release-independent ones)."""
    options: dict[str, Any] = {
        "env": {"VLLM_ASCEND_ENABLE_NZ": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
        "sleep_level": SLEEP_LEVEL,
        "sleep_refuses_env": dict(SLEEP_REFUSES_ENV),
        "weight_loader": "load_weights",
        "raw_logprobs_only": True,
        "dtypes": ENGINE_DTYPES,
        # routing replay's R3 takes the engine's routed experts: not taken from vllm-ascend (not verified here)
        "routes_refused": "polyrl does not take routed experts from vllm-ascend (R3 with it is not verified); use "
                          "rollout.engine=hf or rollout.routing_replay=r2",
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
