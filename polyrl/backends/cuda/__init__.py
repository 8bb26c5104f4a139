"""The cuda backend: varlen attention with sinks/window/GQA (FlashAttention-4 where it measured faster, polyrl's
Triton kernel elsewhere: attention_choice), a Triton decode attention for the hf engine, the fused lm_head log-prob
op, NCCL, rollout with vLLM (or the hf engine).

Importing this module imports nothing from CUDA or Triton; ``detect`` reads torch's build and counts
devices without creating a context, and the kernels are imported on first call.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from polyrl.core.plugins.backend import Availability, Backend, ShardingPolicy
from polyrl.core.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from polyrl.core.compat import Compatibility
    from polyrl.core.plugins.kernels import AttentionLayout


class CudaBackend(Backend):
    name = "cuda"
    device_type = "cuda"
    collective_backend = "nccl"
    capabilities = frozenset({"bf16", "fp16", "fsdp2", "dcp", "rollout:hf", "rollout:vllm", "triton"})
    is_accelerator = True
    # GiB per device for the dry-run memory plan (the nominal HBM of each model; the first is the default).
    device_memory_table: ClassVar[dict[str, float]] = {"H100-80GB": 80.0, "A100-80GB": 80.0, "H200": 141.0, "A100-40GB": 40.0, "L40S": 48.0}
    # Per call: FA4 on full-causal layers where it measured faster, the Triton kernel on sliding-window layers, fp32,
    # unmeasured head dims, other GPUs or without flash_attn.cute (attention_choice; POLYRL_CUDA_ATTENTION overrides).
    attention_kernel = "polyrl.backends.cuda.attention:cuda_varlen_attention"
    # Triton forward (matmul fused into the softmax statistics) and backward (logit gradient recomputed per
    # vocabulary chunk, then dW / dH by cuBLAS): never the [T, V] logits.
    linear_logprobs_kernel = "polyrl.backends.cuda.linear_logprobs:triton_linear_logprobs"
    # The hf engine's decode steps: one Triton launch per layer call (forward only) instead of the dense reference's
    # ~47 torch ops; the reference where a gradient is wanted, for float64, or under POLYRL_CUDA_DECODE=reference.
    decode_attention_kernel = "polyrl.backends.cuda.decode:triton_decode_attention"
    # The loss's per-token gradient inside the forward's token chunks: cuBLAS fp32 logits made once per chunk,
    # three [T, V, H] matmuls instead of four (model.fused_loss).
    linear_logprob_loss_kernel = "polyrl.backends.cuda.linear_logprobs:cublas_linear_logprob_loss"
    # vLLM preferred (rollout.engine: auto) where installed and serving the model; the hf engine otherwise. The
    # vllm engine is the shared polyrl.backends.vllm_engine with the settings below; measured on an H200 with
    # vLLM 0.26.0 (docs/rollout.md: how to bring it to an offline machine).
    rollout_engines = ("vllm", "hf")

    def rollout_engine_problem(self, engine: str) -> str:
        from polyrl.backends.vllm_engine import vllm_problem

        return vllm_problem("vllm") if engine == "vllm" else ""

    def rollout_engine_options(self, engine: str) -> dict[str, Any]:
        if engine != "vllm":
            return {}
        return {
            "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the trainer's process
                    "VLLM_USE_FLASHINFER_SAMPLER": "0"},  # vLLM's own sampler (FlashInfer is not required)
            "gpu_memory_utilization": 0.5,  # vLLM's cap where the KV cache is not sized (no batch size given)
            "size_kv_cache": True,  # the KV cache the rollout needs, not half the GPU (70 GB for a tiny model)
            "sleep_level": 1,  # weights to host memory, KV cache freed while training
            # torch.compile kept (its custom ops match the trainer; eager ones drifted past the probe's bar at 20B),
            # CUDA graphs captured only for the batch sizes a rollout has: GPT-OSS-20B builds in 38.5 s, not 80.2 s
            # (docs/rollout.md, measured)
            "compile": True,
            "graph_sizes": "rollout",
            # logits in fp32 (vLLM's head_dtype override): the log-probs the trainer compares in fp32
            "logits_fp32": True,
            # MLA on sm90 has bf16 / fp16 kernels only (vLLM 0.26: no backend for fp32): DeepSeek's engine runs bf16
            "model_dtypes": {"deepseek_v3": "bfloat16"},
            # weight_loader "auto": the refit (vLLM 0.26 records the checkpoint format); its reload_weights drops
            # GPT-OSS's experts and sinks (written without a weight_loader): 0.079 nats off after one sync
        }

    def precompile(self, layouts: Sequence[AttentionLayout], dtypes: Sequence[torch.dtype],
                   device: torch.device) -> Callable[[], str] | None:
        """The Triton attention kernels of these layouts compiled on a thread pool while the trainer builds
        (polyrl.backends.cuda.precompile; POLYRL_PRECOMPILE=0: not)."""
        from polyrl.backends.cuda.precompile import precompile

        return precompile(layouts, dtypes, device)

    def compatibility(self) -> Compatibility:
        from polyrl.backends.cuda import compat

        return compat.compatibility()

    def kernel_choices(self) -> dict[str, dict[str, str]]:
        # The per-layout attention rule and the decode route, read without a device or a vendor import (polyrl
        # backends runs it).
        from polyrl.backends.cuda.attention_choice import layout_report
        from polyrl.backends.cuda.decode import decode_report
        from polyrl.backends.cuda.linear_logprobs_choice import linear_logprobs_report

        return {"varlen_attention": layout_report(), "decode_attention": decode_report(),
                "linear_logprobs": linear_logprobs_report()}

    def detect(self) -> Availability:
        import torch

        if torch.version.cuda is None:
            return Availability(False, f"torch {torch.__version__} is not a CUDA build")
        if importlib.util.find_spec("triton") is None:
            return Availability(False, "triton is not installed (pip install 'polyrl[cuda]')")
        # device_count() uses NVML / cudaGetDeviceCount and does not create a CUDA context.
        if torch.cuda.device_count() == 0:
            return Availability(False, "no CUDA device visible (check CUDA_VISIBLE_DEVICES and the driver)")
        return Availability(True, "")

    def device_graph(self) -> Callable[..., Callable[[], None]]:
        """CUDA graphs (contract: polyrl.core.plugins.placement.Placement.device_graph)."""
        return capture_cuda_graph

    def sharding_policy(self) -> ShardingPolicy:
        return ShardingPolicy(
            param_dtype="bfloat16",
            reduce_dtype="float32",
            cpu_offload_supported=True,
            env_defaults={
                # Fewer fragmentation OOMs when rollout and training share the GPU.
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                # NVLink multicast (NVLS) can wedge shared hosts; polyrl never needs it.
                "NCCL_NVLS_ENABLE": "0",
            },
        )


def capture_cuda_graph(step: Callable[[], None], before_capture: Callable[[], None] | None = None) -> Callable[[], None]:
    """``step`` warmed up once on a side stream (PyTorch's recipe for capture: lazy cuBLAS / Triton set-up happens
    outside the graph), ``before_capture()``, then captured into a ``torch.cuda.CUDAGraph`` (its own memory pool);
    returns the graph's ``replay``. Capture errors are thread-local: device work from another thread of the
    process during the capture does not break it."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    return graph.replay


@hookimpl
def polyrl_register_backends(register: Callable[[type], None]) -> None:
    register(CudaBackend)
