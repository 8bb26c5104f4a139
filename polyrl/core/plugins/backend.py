"""The Backend interface: what a hardware plugin declares and implements.

A backend is a small class, registered through the ``polyrl_register_backends`` hook. It must be cheap to
construct and must not touch a device in ``__init__`` or ``detect``: detection reads what is installed
and what the OS exposes, it never initialises a runtime (no CUDA context, no NPU init).

Kernels are named, not implemented, by the class: ``attention_kernel``, ``logprobs_kernel``,
``linear_logprobs_kernel`` and ``experts_kernel`` are ``"module:function"`` paths, imported on a backend object's first call of that
kernel and kept on the object (``Backend.kernel``), so vendor modules load only when a kernel runs and never again
per call. A slot left at its default runs the reference implementation in core. ``provided_kernels()`` is derived
from the slots — a kernel is provided when its slot names another function than the reference (or the method is
overridden) — and ``polyrl backends`` lists the rest as falling back to the reference (``kernels_fallback``). A slot that
does not resolve (a typo) makes the backend unavailable with a one-line reason (``availability()``), found
when ``polyrl backends`` / ``polyrl doctor`` run, before any kernel does.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from polyrl.core.compat import Compatibility

# The kernels a backend may provide, the class attribute naming each, and the reference implementation in core
# that runs when the slot is left at its default.
KERNELS: tuple[str, ...] = ("varlen_attention", "logprobs", "linear_logprobs", "experts")
KERNEL_SLOTS: dict[str, str] = {"varlen_attention": "attention_kernel", "logprobs": "logprobs_kernel",
                                "linear_logprobs": "linear_logprobs_kernel", "experts": "experts_kernel"}
REFERENCE_KERNELS: dict[str, str] = {
    "varlen_attention": "polyrl.core.attention.reference:reference_varlen_attention",
    "logprobs": "polyrl.core.algorithms.logprobs:logprobs_and_entropy",
    "linear_logprobs": "polyrl.core.algorithms.linear_logprobs:linear_logprobs_and_entropy",
    "experts": "polyrl.core.models.experts:reference_experts",
}

# The capability vocabulary (docs/plugins.md): what each name in ``Backend.capabilities`` promises. Names outside
# it are reported by ``polyrl backends`` as warnings and fail the conformance kit; a plugin's private flags use
# the "x-" prefix.
CAPABILITIES: dict[str, str] = {
    "fp32": "trains with float32 parameters",
    "bf16": "trains with bfloat16 parameters (and its kernels take bfloat16 inputs)",
    "fp16": "its kernels take float16 inputs",
    "fsdp2": "FSDP2 (fully_shard) works over its collective library",
    "dcp": "torch.distributed.checkpoint saves and loads sharded state on it",
    "triton": "its kernels are Triton kernels (informational)",
}
CAPABILITY_PREFIXES: dict[str, str] = {
    "rollout:": "rollout:<engine> — the rollout engine <engine> runs on it (one per entry of rollout_engines)",
    "x-": "x-<name> — private to the plugin; polyrl never reads it",
}


def unknown_capabilities(capabilities: frozenset[str] | set[str]) -> list[str]:
    """The names in ``capabilities`` outside the vocabulary (sorted)."""
    return sorted(c for c in capabilities
                  if c not in CAPABILITIES and not any(c.startswith(p) and len(c) > len(p) for p in CAPABILITY_PREFIXES))


def one_line(exc: BaseException) -> str:
    """``"TypeError: first line of the message"``: how a plugin's error is reported."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _split_path(path: object) -> tuple[str, str] | None:
    if not isinstance(path, str):
        return None
    module, sep, func = path.partition(":")
    if not sep or not module or not func.isidentifier() or not all(p.isidentifier() for p in module.split(".")):
        return None
    return module, func


def _top_level_names(tree: ast.Module) -> tuple[set[str], bool]:
    """Names a module binds at top level (defs, classes, assignments, imports, also inside if/try), and whether
    it defines a module ``__getattr__`` (then any name may exist)."""
    names: set[str] = set()
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            stack += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                stack += handler.body
    return names, "__getattr__" in names


@functools.lru_cache(maxsize=256)
def static_kernel_problem(path: str) -> str:
    """What is wrong with a ``"module:function"`` kernel path, found without importing the module (vendor
    modules stay unloaded): the module must exist and bind ``function`` at top level. "" when nothing is."""
    parts = _split_path(path)
    if parts is None:
        return f"{path!r} is not a 'module:function' path"
    module, func = parts
    try:
        spec = importlib.util.find_spec(module)
    except Exception as exc:  # a parent package that fails to import
        return f"{path!r}: cannot look up module {module} ({one_line(exc)})"
    if spec is None:
        return f"{path!r}: no module named {module!r}"
    origin = spec.origin or ""
    if not origin.endswith(".py"):
        return ""  # an extension or namespace module: only importing it can tell (resolve_kernel)
    try:
        with open(origin, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=origin)
    except (OSError, SyntaxError, ValueError) as exc:
        return f"{path!r}: cannot read {origin} ({one_line(exc)})"
    names, dynamic = _top_level_names(tree)
    if func not in names and not dynamic:
        return f"{path!r}: module {module} has no function {func!r}"
    return ""


def resolve_kernel(path: str) -> Any:
    """Import ``"module:function"`` and return the function; ``ImportError`` with a one-line reason otherwise.
    Not cached here (checks call it to see the module as it is now); a backend keeps what it resolved for its
    kernels (``Backend.kernel``)."""
    parts = _split_path(path)
    if parts is None:
        raise ImportError(f"{path!r} is not a 'module:function' path")
    module, func = parts
    try:
        fn = getattr(importlib.import_module(module), func)
    except ImportError as exc:
        raise ImportError(f"{path!r}: cannot import {module} ({one_line(exc)})") from exc
    except AttributeError:
        raise ImportError(f"{path!r}: module {module} has no function {func!r}") from None
    if not callable(fn):
        raise ImportError(f"{path!r}: {func} is not callable")
    return fn


@dataclasses.dataclass(frozen=True)
class Availability:
    available: bool
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class ShardingPolicy:
    """What a backend imposes on FSDP2 sharding, whatever the recipe chooses (the recipe's own choices —
    enabled, CPU offload, resharding — are ``polyrl.core.config.ShardingConfig``).

    ``param_dtype``/``reduce_dtype`` are torch dtype names ("float32", "bfloat16") so that the policy is
    printable and comparable without importing torch. ``world_sizes_refused`` lists world sizes the
    collective library cannot handle (HCCL refuses 3, 5, 6, 7 for all_gather_into_tensor), and
    ``world_size_rule`` says which rule refuses them (the refusal's message names it).
    """

    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    cpu_offload_supported: bool = True
    world_sizes_refused: tuple[int, ...] = ()
    world_size_rule: str = ""
    env_defaults: dict[str, str] = dataclasses.field(default_factory=dict)
    # FSDP reduces gradients with plain SUM instead of PREMUL_SUM (gloo and HCCL have no PREMUL_SUM; with the
    # divide factor 1.0 polyrl uses, the two are the same reduction, so SUM is the safe default everywhere).
    force_sum_reduction: bool = True

    def refusal(self, size: int, collective_backend: str) -> str | None:
        """Why the collective library refuses a process group of ``size`` ranks (the rule), or None."""
        if size not in self.world_sizes_refused:
            return None
        return self.world_size_rule or f"{collective_backend} refuses world sizes {list(self.world_sizes_refused)}"


class Backend:
    """Base class of every backend. Subclasses set the class attributes and override what they provide."""

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = "cpu"  # torch device type: "cpu", "cuda", "npu", ...
    collective_backend: ClassVar[str] = "gloo"  # torch.distributed backend name
    # The dtypes its collective library reduces (all_reduce, reduce_scatter), as torch dtype names ("float32",
    # "int64"); empty: every dtype. polyrl.core.distributed never hands one of its reductions another dtype: it
    # reduces those (float64 sums and counts) exactly through a gather, which moves any dtype. Its world sizes:
    # ``ShardingPolicy.world_sizes_refused``.
    collective_reduce_dtypes: ClassVar[frozenset[str]] = frozenset()
    capabilities: ClassVar[frozenset[str]] = frozenset()  # names from CAPABILITIES (docs/plugins.md)
    rollout_engines: ClassVar[tuple[str, ...]] = ("hf",)
    # Selection picks a backend implicitly only when it is an accelerator (cuda, ascend, a ROCm plugin); a
    # CPU plugin runs only when named. The reference (cpu) is the default when no accelerator is available.
    is_accelerator: ClassVar[bool] = False
    is_reference: ClassVar[bool] = False  # the cpu backend: the fallback, not an accelerator
    # "module:function" of the varlen attention kernel, with the signature of
    # polyrl.core.attention.reference.reference_varlen_attention (the default: the exact reference).
    attention_kernel: ClassVar[str] = REFERENCE_KERNELS["varlen_attention"]
    # "module:function" of the log-prob kernel, with the signature of
    # polyrl.core.algorithms.logprobs.logprobs_and_entropy (the default: that chunked fp32 reference).
    logprobs_kernel: ClassVar[str] = REFERENCE_KERNELS["logprobs"]
    # "module:function" of the fused lm_head + log-prob + entropy kernel, with the signature of
    # polyrl.core.algorithms.linear_logprobs.linear_logprobs_and_entropy (the default: that chunked reference).
    linear_logprobs_kernel: ClassVar[str] = REFERENCE_KERNELS["linear_logprobs"]
    # "module:function" of the MoE experts kernel, with the signature of
    # polyrl.core.models.experts.reference_experts (the default: transformers' grouped_mm path, torch._grouped_mm).
    experts_kernel: ClassVar[str] = REFERENCE_KERNELS["experts"]

    # A module ``polyrl doctor --backend NAME --selfcheck`` runs as ``python -m <module>`` (in a child process: it
    # may import the vendor library) where the backend is available: it checks on the device what the backend's
    # kernels assume (exit 0: every case passed). "" : the backend has none.
    selfcheck_module: ClassVar[str] = ""

    # Memory of one device in GiB by device model, for the dry-run memory plan (read without the hardware; the
    # first entry is the model assumed when none is named). ``polyrl run --dry-run --device-memory GIB`` overrides.
    device_memory_table: ClassVar[dict[str, float]] = {}

    # Filled in by the plugin manager: the distribution the backend came from.
    distribution: str = ""
    version: str = ""

    def detect(self) -> Availability:
        """Is the hardware and software present? Must not initialise a device."""
        raise NotImplementedError

    def kernel(self, name: str) -> Callable[..., Any]:
        """The function kernel ``name`` (one of ``KERNELS``) runs on this backend: its slot's ``"module:function"``,
        imported on the first call and kept on this object, so that a kernel call never imports again (a module
        lookup per attention layer and step would be on the hot path)."""
        cache = self.__dict__.setdefault("_resolved_kernels", {})
        fn = cache.get(name)
        if fn is None:
            fn = cache[name] = resolve_kernel(getattr(self, KERNEL_SLOTS[name]))
        return fn

    # --- kernels -------------------------------------------------------------------------------
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
        """Packed causal attention with optional window and sinks (contract in polyrl.core.attention).

        Runs the function named by ``attention_kernel`` (``kernel``: imported on the first call, so that vendor
        modules (triton, torch_npu) load only when a kernel actually runs). Override the method only when a
        backend needs more than a function call.
        """
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
        return self.kernel("logprobs")(logits, labels, chunk_size=chunk_size, temperature=temperature, compute_entropy=compute_entropy)

    # --- rollout engines (rollout_engines: in order of preference; ``rollout.engine: auto`` takes the first ready)
    def rollout_engine_problem(self, engine: str) -> str:
        """Why ``engine`` cannot run here ("" when it can): e.g. its package is missing. Must not import it."""
        return ""

    def rollout_engine_options(self, engine: str) -> dict[str, Any]:
        """This backend's settings for ``engine`` (the vLLM engine reads ``polyrl.backends.vllm_engine.VllmSettings``
        fields from it: environment, memory utilisation, sleep level, in-place sync); {} for the defaults."""
        return {}

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

    def experts(self, module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """A transformers MoE experts module's forward (``module``: GptOssExperts, DeepseekV3NaiveMoe, ... with
        its fused 3-D expert weights) on hidden_states [T, H] routed by top_k_index / top_k_weights [T, k] ->
        [T, H] (contract: polyrl.core.models.experts). Runs ``experts_kernel``; a model built by polyrl reaches it
        through transformers' experts implementation ``"polyrl"``."""
        return self.kernel("experts")(module, hidden_states, top_k_index, top_k_weights)

    # --- sharding / environment ---------------------------------------------------------------
    def sharding_policy(self) -> ShardingPolicy:
        return ShardingPolicy()

    def check_world_size(self, world_size: int) -> None:
        """Refuse world sizes the collective library cannot handle, with a clear message."""
        from polyrl.core.errors import BadInputError

        rule = self.sharding_policy().refusal(world_size, self.collective_backend)
        if rule is not None:
            raise BadInputError(f"backend {self.name!r}: world size {world_size} is refused: {rule}")

    # --- expert parallelism (MoE) ---------------------------------------------------------------
    # The MoE layers of an expert-parallel model (``sharding.expert_parallel`` > 1) send each token to the ranks
    # holding its experts and bring the results back through these three methods. The defaults are
    # torch.distributed's ``all_to_all_single`` with variable split sizes (NCCL, HCCL and gloo all have it) and
    # the permutations of polyrl.core.distributed.expert_parallel around it; a backend with a fused MoE
    # dispatch/combine (one kernel that permutes and communicates) overrides ``expert_dispatch`` and
    # ``expert_combine`` together, keeping their contract (that module's ``dispatch`` / ``combine``).
    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        group: Any = None,
    ) -> None:
        """``output`` <- the rows every rank of ``group`` sends this one: row block r of ``input`` (sizes
        ``input_split_sizes``, None: equal) goes to rank r; blocks arrive in rank order (``output_split_sizes``).
        Not differentiable by itself (the MoE layer wraps it in autograd)."""
        import torch.distributed as dist

        dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)

    def expert_dispatch(self, hidden: torch.Tensor, expert_ids: torch.Tensor, *, num_experts: int,
                        group: Any = None) -> Any:
        """Send each of the ``k`` copies of every token (hidden [T, H], expert_ids [T, k] global expert indices) to
        the rank of ``group`` holding its expert (rank r holds experts [r * E/ep, (r + 1) * E/ep)). Returns an
        ``ExpertDispatch``: the rows this rank's experts must compute, grouped by local expert in ascending order,
        with their local expert ids, and what ``expert_combine`` needs to bring them back. Differentiable in
        ``hidden``. ``group`` None: one rank holds every expert (the rows are only permuted)."""
        from polyrl.core.distributed.expert_parallel import dispatch

        return dispatch(self, hidden, expert_ids, num_experts=num_experts, group=group)

    def expert_combine(self, expert_out: torch.Tensor, dispatched: Any, weights: torch.Tensor) -> torch.Tensor:
        """The inverse of ``expert_dispatch``: ``expert_out`` (one row per dispatched row, in its order) goes back
        to the tokens' ranks, where each token's ``k`` rows are weighted by ``weights`` [T, k] and summed, in
        fp32 or wider when ``weights`` is, into [T, H] of the tokens' dtype. Differentiable in both tensors."""
        from polyrl.core.distributed.expert_parallel import combine

        return combine(self, expert_out, dispatched, weights)

    # --- device placement ----------------------------------------------------------------------
    # The one place that decides where things live (core never compares device types). The rule, for every
    # built-in backend (docs/devices.md): models, training batches, scores, masks and advantages live on
    # ``device(local_rank)``; every random generator the trainer owns lives on the CPU (``generator``), so a
    # checkpoint's generator states load on any backend; sampling draws its uniforms on the host from per-sequence
    # CPU generators (polyrl.core.rollout.sampling), so no device generator is ever consumed.
    def device(self, local_rank: int = 0) -> Any:
        """The torch device of this process's rank. Only called once a run has started."""
        import torch

        return torch.device(self.device_type, local_rank)

    def bind_device(self, local_rank: int = 0) -> Any:
        """Make ``device(local_rank)`` the process's current device (before the process group exists, so the
        collective library does not guess); returns it. The default uses torch's device-generic module."""
        import torch

        device = self.device(local_rank)
        torch.get_device_module(self.device_type).set_device(device)
        return device

    def comm_device(self, local_rank: int = 0) -> Any:
        """Where tensors handed to a collective must live (nccl/hccl reduce device memory only)."""
        return self.device(local_rank)

    def process_group_options(self, local_rank: int = 0) -> dict[str, Any]:
        """Extra ``init_process_group`` arguments: by default the bound device (eager connection set-up)."""
        return {"device_id": self.device(local_rank)}

    def generator(self, seed: int) -> Any:
        """A seeded random generator for host-side decisions (sampling seeds, mini-batch shuffles): on the CPU,
        so that its state is portable across backends and the streams are the same everywhere."""
        import torch

        return torch.Generator(device="cpu").manual_seed(seed)

    def device_rng_state(self) -> Any:
        """The device's default generator state for a checkpoint (None when the device has none of its own)."""
        import torch

        return torch.get_device_module(self.device_type).get_rng_state()

    def set_device_rng_state(self, state: Any) -> None:
        if state is None:
            return
        import torch

        torch.get_device_module(self.device_type).set_rng_state(state)

    def memory_metrics(self) -> dict[str, float]:
        """Per-step memory figures for metrics.jsonl: the device's peak allocated GiB since the last call."""
        import torch

        module = torch.get_device_module(self.device_type)
        if not hasattr(module, "max_memory_allocated"):
            return {}
        peak = module.max_memory_allocated() / 2**30
        module.reset_peak_memory_stats()
        return {"memory/peak_gib": peak}

    def device_memory_gib(self, model: str | None = None, *, local_world_size: int = 1) -> tuple[str, float]:
        """(device model, GiB of memory of one device) from ``device_memory_table``, without touching a device.
        ``model`` None: the table's first entry. ``local_world_size``: processes per node (a backend whose
        processes share one memory, as the cpu backend's, divides by it)."""
        from polyrl.core.errors import BadInputError

        table = self.device_memory_table
        if not table:
            raise BadInputError(f"backend {self.name!r} declares no device memory; give it with --device-memory GIB")
        if model is None:
            model = next(iter(table))
        if model not in table:
            raise BadInputError(f"backend {self.name!r}: unknown device {model!r} (known: {', '.join(table)})")
        return model, float(table[model])

    # --- compatibility ---------------------------------------------------------------------------
    def compatibility(self) -> Compatibility:
        """This backend's rows of the compatibility table that ``polyrl doctor`` checks: the distributions to
        report for it, facts read from the machine (a toolkit's version), and rules (polyrl.core.compat). Read
        metadata and files only, never import a vendor module. Default: none beyond core's own rows."""
        from polyrl.core.compat import Compatibility

        return Compatibility()

    # --- declarations, availability, reporting ----------------------------------------------------
    def kernel_paths(self) -> dict[str, str]:
        """kernel name -> the "module:function" this backend runs for it."""
        return {k: getattr(self, slot) for k, slot in KERNEL_SLOTS.items()}

    def provided_kernels(self) -> frozenset[str]:
        """The kernels this backend provides itself: its slot names another function than the reference, or it
        overrides the kernel method. The reference backend's kernels are its own."""
        if self.is_reference:
            return frozenset(KERNELS)
        return frozenset(
            k for k, path in self.kernel_paths().items()
            if path != REFERENCE_KERNELS[k] or getattr(type(self), k) is not getattr(Backend, k)
        )

    @property
    def native_kernels(self) -> frozenset[str]:
        """Deprecated alias of ``provided_kernels()``, kept for one minor version for plugins that read it."""
        warnings.warn("Backend.native_kernels is deprecated; call Backend.provided_kernels()", DeprecationWarning,
                      stacklevel=2)
        return self.provided_kernels()

    def kernels_fallback(self) -> list[str]:
        provided = self.provided_kernels()
        return [k for k in KERNELS if k not in provided]

    def declaration_problems(self, *, resolve: bool = False) -> list[str]:
        """What is wrong with the class's declarations, one line each: kernel paths that do not resolve (checked
        from the source without importing it; ``resolve=True`` imports the kernels, for an available backend)."""
        problems = []
        for kernel, path in self.kernel_paths().items():
            slot = KERNEL_SLOTS[kernel]
            problem = static_kernel_problem(path) if isinstance(path, str) else f"{path!r} is not a string"
            if not problem and resolve:
                try:
                    resolve_kernel(path)
                except ImportError as exc:
                    problem = str(exc)
            if problem:
                problems.append(f"{slot} {problem}")
        return problems

    def declaration_warnings(self) -> list[str]:
        unknown = unknown_capabilities(self.capabilities)
        if not unknown:
            return []
        # Self-contained (an installed wheel has no docs/): the vocabulary itself, and the prefixes.
        known = ", ".join(CAPABILITIES) + ", " + ", ".join(f"{p}<name>" for p in CAPABILITY_PREFIXES)
        return [f"unknown capabilities {unknown} (known: {known}; x-<name> is private to the plugin)"]

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

    def _engine_problem(self, engine: str) -> str:
        try:
            return str(self.rollout_engine_problem(engine))
        except Exception as exc:  # a plugin's bug is reported, not raised
            return f"rollout_engine_problem() raised {one_line(exc)}"

    def origin(self) -> str:
        """``"cuda (polyrl 0.1.0)"``: the backend, its distribution and version (the run log's first line)."""
        dist = " ".join(x for x in (self.distribution, self.version) if x) or "registered in-process"
        return f"{self.name} ({dist})"

    def describe(self) -> dict[str, Any]:
        avail = self.availability()
        return {
            "name": self.name,
            "version": self.version,
            "distribution": self.distribution,
            "device_type": self.device_type,
            "collective_backend": self.collective_backend,
            "is_accelerator": bool(self.is_accelerator),
            "is_reference": bool(self.is_reference),
            "available": avail.available,
            "reason": avail.reason,
            "capabilities": sorted(self.capabilities),
            "kernels": self.kernel_paths(),
            "native_kernels": sorted(self.provided_kernels()),
            "kernels_fallback": self.kernels_fallback(),
            "rollout_engines": list(self.rollout_engines),
            # per engine: "" when it can run here, else why not (``rollout_engine_problem``, isolated)
            "rollout_engine_problems": {e: self._engine_problem(e) for e in self.rollout_engines},
            "problems": self.declaration_problems(),
            "warnings": self.declaration_warnings(),
        }
