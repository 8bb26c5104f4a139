"""``BackendCore``: the small core every backend implements — who it is, whether its hardware is here, its devices,
and its kernels. Everything else a backend may change is a named part composed into ``Backend``
(polyrl.core.plugins.backend): placement, collectives, engine options, introspection.

The core must be cheap to construct and must not touch a device in ``__init__`` or ``detect``: detection reads
what is installed and what the OS exposes, it never initialises a runtime (no CUDA context, no NPU init).

Kernels are named, not implemented, by the class: ``attention_kernel``, ``logprobs_kernel``,
``linear_logprobs_kernel``, ``experts_kernel``, ``decode_attention_kernel`` and ``linear_logprob_loss_kernel`` are
``"module:function"`` paths
(polyrl.core.plugins.kernels), imported on a backend object's first call of that kernel and kept on the object
(``kernel``), so vendor modules load only when a kernel runs and never again per call. A slot left at its default
runs the reference implementation in core. A slot that does not resolve (a typo) makes the backend unavailable with
a one-line reason (``availability()``), found when ``polyrl backends`` / ``polyrl doctor`` run, before any kernel
does.

The declarations the parts read (the collective library, the rollout engines, the device memory table, the
self-check) are class attributes here too, so that a backend is declared in one class body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from polyrl.core.plugins import kernels as _kernels
from polyrl.core.plugins.kernels import (
    KERNEL_SLOTS,
    REFERENCE_KERNELS,
    AttentionLayout,
    one_line,
    static_kernel_problem,
)

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclasses.dataclass(frozen=True)
class Availability:
    available: bool
    reason: str = ""


class BackendCore:
    """Identity, detection, devices and kernels. Subclass ``Backend`` (which composes the parts), not this."""

    # --- identity ------------------------------------------------------------------------------------------
    name: ClassVar[str] = ""
    device_type: ClassVar[str] = "cpu"  # torch device type: "cpu", "cuda", "npu", ...
    capabilities: ClassVar[frozenset[str]] = frozenset()  # names from CAPABILITIES (docs/plugins.md)
    # Selection picks a backend implicitly only when it is an accelerator (cuda, ascend, a ROCm plugin); a
    # CPU plugin runs only when named. The reference (cpu) is the default when no accelerator is available.
    is_accelerator: ClassVar[bool] = False
    is_reference: ClassVar[bool] = False  # the cpu backend: the fallback, not an accelerator
    # Filled in by the plugin manager: the distribution the backend came from.
    distribution: str = ""
    version: str = ""

    # --- what the parts read (polyrl.core.plugins.{collectives,engines,placement,introspection}) ------------------
    collective_backend: ClassVar[str] = "gloo"  # torch.distributed backend name
    # The dtypes its collective library reduces (all_reduce, reduce_scatter), as torch dtype names ("float32",
    # "int64"); empty: every dtype. polyrl.core.distributed never hands one of its reductions another dtype: it
    # reduces those (float64 sums and counts) exactly through a gather, which moves any dtype. Its world sizes:
    # ``ShardingPolicy.world_sizes_refused``.
    collective_reduce_dtypes: ClassVar[frozenset[str]] = frozenset()
    rollout_engines: ClassVar[tuple[str, ...]] = ("hf",)  # in order of preference (``rollout.engine: auto``)
    # Memory of one device in GiB by device model, for the dry-run memory plan (read without the hardware; the
    # first entry is the model assumed when none is named). ``polyrl run --dry-run --device-memory GIB`` overrides.
    device_memory_table: ClassVar[dict[str, float]] = {}
    # A module ``polyrl doctor --backend NAME --selfcheck`` runs as ``python -m <module>`` (in a child process: it
    # may import the vendor library) where the backend is available: it checks on the device what the backend's
    # kernels assume (exit 0: every case passed). "" : the backend has none.
    selfcheck_module: ClassVar[str] = ""

    # --- kernel slots ("module:function", signatures of the reference named) --------------------------------------
    # polyrl.core.attention.reference.reference_varlen_attention (the default: the exact reference).
    attention_kernel: ClassVar[str] = REFERENCE_KERNELS["varlen_attention"]
    # polyrl.core.algorithms.logprobs.logprobs_and_entropy (the default: that chunked fp32 reference).
    logprobs_kernel: ClassVar[str] = REFERENCE_KERNELS["logprobs"]
    # polyrl.core.algorithms.linear_logprobs.linear_logprobs_and_entropy (the default: that chunked reference).
    linear_logprobs_kernel: ClassVar[str] = REFERENCE_KERNELS["linear_logprobs"]
    # polyrl.core.models.experts.reference_experts (the default: transformers' grouped_mm path, torch._grouped_mm).
    experts_kernel: ClassVar[str] = REFERENCE_KERNELS["experts"]
    # polyrl.core.attention.reference.reference_decode_attention (the default: the dense fp32 reference of the
    # generation form, differentiable; the hf engine's decode steps run this slot).
    decode_attention_kernel: ClassVar[str] = REFERENCE_KERNELS["decode_attention"]
    # polyrl.core.algorithms.linear_loss.linear_logprob_loss (the default: that reference, which recomputes each
    # chunk's logits; a backend's own keeps them between the statistics and the gradient).
    linear_logprob_loss_kernel: ClassVar[str] = REFERENCE_KERNELS["linear_logprob_loss"]

    # --- detection -------------------------------------------------------------------------------------------
    def detect(self) -> Availability:
        """Is the hardware and software present? Must not initialise a device."""
        raise NotImplementedError

    def availability(self) -> Availability:
        """``detect()``, isolated (an exception is an unavailable backend with the error's line), after the
        declarations are checked (a kernel path that does not resolve makes the backend unusable)."""
        problems = self.declaration_problems()
        if problems:
            return Availability(False, f"broken declaration: {problems[0]}")
        try:
            avail = self.detect()
        except Exception as exc:  # a plugin's bug must not take the command down
            return Availability(False, f"detect() raised {one_line(exc)}")
        if not isinstance(avail, Availability):
            return Availability(False, f"detect() returned {avail!r}, not an Availability")
        return avail

    def kernel_paths(self) -> dict[str, str]:
        """kernel name -> the "module:function" this backend runs for it."""
        return {k: getattr(self, slot) for k, slot in KERNEL_SLOTS.items()}

    def declaration_problems(self, *, resolve: bool = False) -> list[str]:
        """What is wrong with the class's declarations, one line each: kernel paths that do not resolve (checked
        from the source without importing it; ``resolve=True`` imports the kernels, for an available backend)."""
        problems = []
        for kernel, path in self.kernel_paths().items():
            slot = KERNEL_SLOTS[kernel]
            problem = static_kernel_problem(path) if isinstance(path, str) else f"{path!r} is not a string"
            if not problem and resolve:
                try:
                    _kernels.resolve_kernel(path)
                except ImportError as exc:
                    problem = str(exc)
            if problem:
                problems.append(f"{slot} {problem}")
        return problems

    # --- devices ---------------------------------------------------------------------------------------------
    # Models, training batches, scores, masks and advantages live on ``device(local_rank)`` (docs/devices.md);
    # where the rest lives (generators, collectives' tensors) is the placement part's.
    def device(self, local_rank: int = 0) -> torch.device:
        """The torch device of this process's rank. Only called once a run has started."""
        import torch

        return torch.device(self.device_type, local_rank)

    def bind_device(self, local_rank: int = 0) -> torch.device:
        """Make ``device(local_rank)`` the process's current device (before the process group exists, so the
        collective library does not guess); returns it. The default uses torch's device-generic module."""
        import torch

        device = self.device(local_rank)
        torch.get_device_module(self.device_type).set_device(device)
        return device

    # --- kernels ---------------------------------------------------------------------------------------------
    def kernel(self, name: str) -> Callable[..., Any]:
        """The function kernel ``name`` (one of ``KERNELS``) runs on this backend: its slot's ``"module:function"``,
        imported on the first call and kept on this object, so that a kernel call never imports again (a module
        lookup per attention layer and step would be on the hot path)."""
        cache = self.__dict__.setdefault("_resolved_kernels", {})
        fn = cache.get(name)
        if fn is None:
            fn = cache[name] = _kernels.resolve_kernel(getattr(self, KERNEL_SLOTS[name]))
        return fn

    def varlen_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        scale: float,
        window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Packed causal attention with optional window and sinks (contract in polyrl.core.attention): q [T, Hq, D],
        k [T, Hkv, D], v [T, Hkv, Dv] -> [T, Hq, Dv]. Runs the function named by ``attention_kernel``. Override the
        method only when a backend needs more than a function call."""
        return self.kernel("varlen_attention")(q, k, v, cu_seqlens, scale=scale, window=window, sinks=sinks)

    def logprobs(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        *,
        chunk_size: int = 1024,
        temperature: float = 1.0,
        compute_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-prob of ``labels`` and entropy of softmax(logits / temperature), both fp32 [..., T]
        (contract: polyrl.core.algorithms.logprobs.logprobs_and_entropy). Runs ``logprobs_kernel``."""
        return self.kernel("logprobs")(logits, labels, chunk_size=chunk_size, temperature=temperature,
                                       compute_entropy=compute_entropy)

    def linear_logprobs(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        chunk_size: int = 1024,
        temperature: float = 1.0,
        compute_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logprobs`` of the logits ``hidden @ weight.T + bias`` without materialising them: hidden [..., T, H],
        weight [V, H] -> fp32 (logp, entropy) [..., T], differentiable in hidden, weight and bias (contract:
        polyrl.core.algorithms.linear_logprobs.linear_logprobs_and_entropy). Runs ``linear_logprobs_kernel``."""
        return self.kernel("linear_logprobs")(hidden, weight, labels, bias=bias, chunk_size=chunk_size,
                                              temperature=temperature, compute_entropy=compute_entropy)

    def linear_logprob_loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        token_grad: Callable[..., Any],
        *,
        bias: torch.Tensor | None = None,
        chunk_size: int = 1024,
        temperature: float = 1.0,
        compute_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``linear_logprobs`` with the loss's gradient taken inside the forward: hidden [N, H], weight [V, H],
        labels [N]; ``token_grad(t0, t1, logp, ent) -> (g_lp, g_ent)`` gives d loss / d logp and d loss / d entropy
        of each chunk of rows. Returns (anchor, logp, entropy): a 0-d zero whose gradient carries hidden's,
        weight's and bias's, and the fp32 values, not differentiable (contract:
        polyrl.core.algorithms.linear_loss). Runs ``linear_logprob_loss_kernel``."""
        return self.kernel("linear_logprob_loss")(hidden, weight, labels, token_grad, bias=bias,
                                                  chunk_size=chunk_size, temperature=temperature,
                                                  compute_entropy=compute_entropy)

    def experts(self, module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """A transformers MoE experts module's forward (``module``: GptOssExperts, DeepseekV3NaiveMoe, ... with
        its fused 3-D expert weights) on hidden_states [T, H] routed by top_k_index / top_k_weights [T, k] ->
        [T, H] (contract: polyrl.core.models.experts). Runs ``experts_kernel``; a model built by polyrl reaches it
        through transformers' experts implementation ``"polyrl"``."""
        return self.kernel("experts")(module, hidden_states, top_k_index, top_k_weights)

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None,
        scale: float,
        window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of the last Sq positions of each row over its KV cache (contract in
        polyrl.core.attention.decode_attention): q [B, Sq, Hq, D], k_cache [B, Sk, Hkv, D], v_cache [B, Sk, Hkv, Dv],
        key_padding_mask None or bool [B, Sk] -> [B, Sq, Hq, Dv]. Runs the function named by
        ``decode_attention_kernel``; the model's ``"polyrl"`` attention calls it for generation (KV cache)."""
        return self.kernel("decode_attention")(q, k_cache, v_cache, key_padding_mask=key_padding_mask, scale=scale,
                                               window=window, sinks=sinks)

    def precompile(self, layouts: Sequence[AttentionLayout], dtypes: Sequence[torch.dtype],
                   device: torch.device) -> Callable[[], str] | None:
        """Start compiling, in the background, the kernels ``varlen_attention`` will run for these layouts
        (``AttentionLayout``: head counts, head dims, window, sinks) and dtypes on ``device``, for a backend whose
        kernels compile on first use; return a function that waits for the compiles and returns one line for the
        run's log (it may have a ``cancel()``, which the trainer calls instead when its build fails). The trainer
        calls this before it builds the task, tokenizer and models, and waits before the rollout engine is built, so
        the compiles overlap the build instead of the first step. Must not fail a run: a compile that fails here is
        compiled (and fails) again at its first real call. The default compiles nothing and returns None."""
        return None
