"""Stand-ins of vllm-ascend releases, on the CPU: a module ``vllm`` whose ``LLM`` behaves, where polyrl's vllm
engine touches it, as vllm-ascend's NPU worker and allocator do at that release — never a claim about an NPU.

vllm-ascend cannot run here (no NPU, no CANN). What polyrl relies on was read in its sources at each tag, and is
written below independently of polyrl's own table (polyrl.backends.ascend.compat), so that a wrong row there
fails here:

- every tag: ``CaMemAllocator.__init__`` (sleep mode) asserts ``"expandable_segments:True"`` is absent from
  ``PYTORCH_NPU_ALLOC_CONF`` (vllm_ascend/device_allocator/camem.py);
- ``NPUWorker.reload_weights`` from v0.24.0rc1 only (vllm_ascend/worker/worker.py); ``collective_rpc`` with a
  method name the worker lacks raises vLLM's ``NotImplementedError("Method 'reload_weights' is not
  implemented.")`` (vllm/v1/serial_utils.py run_method); a callable runs with the worker as first argument;
- v0.13's attention takes GPT-OSS's sinks in ``**kwargs`` and drops them (sinks from v0.15.0rc1);
- every tag's attention passes ``pre_tokens = sliding_window`` to the fused attention ops, which keep
  ``pre_tokens + 1`` keys per query (vllm_ascend/attention/attention_v1.py); at decode another op runs
  (``npu_fused_infer_attention_score``): ``decode_window="ignored"`` models a decode kernel that drops the band
  (a fused inference op that does not apply the band to a single query), to show the decode probe catches what the prefill probe
  cannot;
- the fused attention ops (``npu_fusion_attention``, ``npu_fused_infer_attention_score``) take float16 and bfloat16
  only: an engine in the trainer's float32 fails at its first forward.

The model itself is transformers' eager implementation loaded from the engine's export, its window set per call
from the rules above; sleeping, generating and loading follow vLLM's API (``generate``, ``prompt_logprobs``,
``collective_rpc``, ``sleep`` / ``wake_up``, ``reset_prefix_cache``, ``llm_engine.engine_core.shutdown``).
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any

import torch

CAMEM_ASSERT = ("Expandable segments are not compatible with memory pool. Please track "
                "https://github.com/pytorch/pytorch/issues/147851 for the latest updates.")


@dataclasses.dataclass(frozen=True)
class Release:
    version: str
    reload_weights: bool
    gpt_oss_sinks: bool
    decode_window: str = "pre_tokens"  # "pre_tokens": pre_tokens + 1 keys as at prefill; "ignored": all keys
    # Decode runs on weights the post-load processing derives once from the loaded ones (vllm-ascend's MLA builds
    # its absorbed W_UV / W_UK_T from kv_b_proj in process_weights_after_loading, vllm_ascend/attention/mla_v1.py):
    # modelled for any model as a copy of its weights taken by the processing; prefill reads the loaded weights.
    decode_from_processed: bool = False


RELEASES = {
    "0.13.0": Release("0.13.0", reload_weights=False, gpt_oss_sinks=False),
    "0.14.0rc1": Release("0.14.0rc1", reload_weights=False, gpt_oss_sinks=False),
    "0.15.0rc1": Release("0.15.0rc1", reload_weights=False, gpt_oss_sinks=True),
    "0.18.0": Release("0.18.0", reload_weights=False, gpt_oss_sinks=True),
    "0.23.0": Release("0.23.0", reload_weights=False, gpt_oss_sinks=True),
    "0.24.0rc1": Release("0.24.0rc1", reload_weights=True, gpt_oss_sinks=True),
}


@dataclasses.dataclass
class Logprob:
    logprob: float


@dataclasses.dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str


@dataclasses.dataclass
class RequestOutput:
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None


class SamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=16, stop_token_ids=None,
                 ignore_eos=False, seed=None, logprobs=None, detokenize=True, prompt_logprobs=None):
        self.temperature, self.top_p, self.top_k, self.max_tokens = temperature, top_p, top_k, max_tokens
        self.stop_token_ids, self.seed, self.prompt_logprobs = list(stop_token_ids or []), seed, prompt_logprobs


class _Model:
    """What ``worker.get_model()`` returns: vLLM's model with its ``load_weights(iterable of (name, tensor))``."""

    def __init__(self, hf: Any, release: Release, calls: list[str]):
        self.hf, self.release, self.calls = hf, release, calls
        self.decode_state: dict[str, torch.Tensor] | None = None
        self.derive_decode_weights()  # at build, as vLLM processes the weights once after loading

    def derive_decode_weights(self) -> None:
        if self.release.decode_from_processed:
            self.decode_state = {k: v.detach().clone() for k, v in self.hf.state_dict().items()}

    def load_weights(self, weights) -> set[str]:
        state = self.hf.state_dict()
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                state[name].copy_(tensor)  # an unknown name is a KeyError, as in vLLM's loaders
                loaded.add(name)
        self.calls.append("load_weights")
        return loaded


class _Worker:
    def __init__(self, llm: LLM):
        self._llm = llm
        self.model_config = types.SimpleNamespace(dtype=llm.kwargs["dtype"])  # what post-processing reads

    def get_model(self) -> _Model:
        self._llm.check_awake("load weights")
        return self._llm.model


class _WorkerWithReload(_Worker):
    def reload_weights(self, weights_iterator=None, **_: Any) -> None:
        self._llm.check_awake("reload weights")
        self._llm.model.load_weights(weights_iterator)
        self._llm.calls.append("reload_weights")


class LLM:
    release: Release = RELEASES["0.18.0"]  # the module built by ``install`` sets its release

    def __init__(self, model: str, *, dtype: str = "float32", enable_sleep_mode: bool = False,
                 hf_overrides: dict | None = None, max_model_len: int | None = None, load_format: str = "auto",
                 **_: Any):
        from transformers import AutoConfig, AutoModelForCausalLM

        if enable_sleep_mode:
            conf = os.environ.get("PYTORCH_NPU_ALLOC_CONF", "")
            assert "expandable_segments:True" not in conf, CAMEM_ASSERT
        self.calls: list[str] = []
        self.kwargs = {"dtype": dtype, "enable_sleep_mode": enable_sleep_mode, "hf_overrides": hf_overrides,
                       "load_format": load_format, **_}
        if load_format == "dummy":  # vLLM's dummy loader: the architecture from config.json, random weights
            config = AutoConfig.from_pretrained(model)
            hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=getattr(torch, dtype))
        else:
            hf = AutoModelForCausalLM.from_pretrained(model, attn_implementation="eager", dtype=getattr(torch, dtype))
        hf.eval()
        self.model = _Model(hf, self.release, self.calls)
        window = (hf_overrides or {}).get("sliding_window", getattr(hf.config, "sliding_window", None))
        # pre_tokens = sliding_window: the fused ops keep pre_tokens + 1 keys per query
        self.prefill_keys = window + 1 if window else None
        self.decode_keys = (self.prefill_keys if self.release.decode_window == "pre_tokens" else 1 << 30) if window else None
        self.asleep = False
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=lambda: None))
        self._worker = (_WorkerWithReload if self.release.reload_weights else _Worker)(self)

    def check_awake(self, what: str) -> None:
        if self.asleep:
            raise RuntimeError(f"vllm-ascend stand-in: cannot {what} while the engine sleeps (call wake_up)")

    # --- vLLM's API ---------------------------------------------------------------------------------------
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None) -> list[Any]:
        if isinstance(method, str):
            try:
                func = getattr(self._worker, method)
            except AttributeError:
                raise NotImplementedError(f"Method {method!r} is not implemented.") from None
            return [func(*args, **(kwargs or {}))]
        return [method(self._worker, *args, **(kwargs or {}))]

    def sleep(self, level: int = 1) -> None:
        self.asleep = True

    def wake_up(self, tags=None) -> None:
        self.asleep = False

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def generate(self, requests, params, use_tqdm=False) -> list[RequestOutput]:
        self.check_awake("generate")
        params = params if isinstance(params, list) else [params] * len(requests)
        return [self._one(list(r["prompt_token_ids"]), p) for r, p in zip(requests, params)]

    # --- the model at prefill and at decode ----------------------------------------------------------------
    @torch.no_grad()
    def _logits(self, ids: list[int], keys: int | None, decode: bool = False) -> torch.Tensor:
        if decode and self.model.decode_state is not None:  # the decode weights the processing derived
            live = {k: v.detach().clone() for k, v in self.model.hf.state_dict().items()}
            self.model.hf.load_state_dict(self.model.decode_state)
            try:
                return self._logits(ids, keys)
            finally:
                self.model.hf.load_state_dict(live)
        hf = self.model.hf
        dtype = next(hf.parameters()).dtype
        if dtype not in (torch.float16, torch.bfloat16):  # the fused attention ops' dtypes, every tag
            raise RuntimeError(f"npu_fused_infer_attention_score: query dtype {dtype} is not supported "
                               "(float16, bfloat16)")
        saved_window = getattr(hf.config, "sliding_window", None)
        saved_sinks = {}
        if keys is not None:
            hf.config.sliding_window = keys
        if not self.release.gpt_oss_sinks:  # v0.13: the sinks never reach the attention
            for name, module in hf.named_modules():
                if hasattr(module, "sinks"):
                    saved_sinks[name] = module.sinks.detach().clone()
                    module.sinks.fill_(float("-inf"))
        try:
            return hf(input_ids=torch.tensor([ids])).logits[0].float()
        finally:
            hf.config.sliding_window = saved_window
            for name, module in hf.named_modules():
                if name in saved_sinks:
                    module.sinks.copy_(saved_sinks[name])

    def _one(self, prompt: list[int], p: SamplingParams) -> RequestOutput:
        prompt_logprobs = None
        logits = self._logits(prompt, self.prefill_keys)
        if p.prompt_logprobs is not None:
            lp = torch.log_softmax(logits, -1)
            prompt_logprobs = [None] + [{t: Logprob(float(lp[i - 1, t]))} for i, t in enumerate(prompt) if i > 0]
        gen = torch.Generator().manual_seed(int(p.seed or 0))
        ids, logprobs, reason = [], [], "length"
        last = logits[-1]  # the first token comes from the prefill
        for _ in range(p.max_tokens):
            lp = torch.log_softmax(last / p.temperature, -1)
            tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
            ids.append(tok)
            logprobs.append({tok: Logprob(float(lp[tok]))})
            if tok in p.stop_token_ids:
                reason = "stop"
                break
            last = self._logits(prompt + ids, self.decode_keys, decode=True)[-1]  # one decode step
        return RequestOutput([CompletionOutput(ids, logprobs, reason)], prompt_logprobs)


def _process_weights_after_loading(model: _Model, model_config: Any, target_device: Any) -> None:
    """vLLM's post-load processing (vllm/model_executor/model_loader/utils.py), as the engine calls it after a
    sync through the model's ``load_weights``: recorded, and the decode weights derived (``decode_from_processed``)."""
    model.calls.append("process_weights_after_loading")
    model.derive_decode_weights()


def modules(release: Release) -> dict[str, types.ModuleType]:
    """``sys.modules`` entries standing for vllm-ascend ``release``: ``vllm`` and the one submodule the engine's
    worker functions import (``vllm.model_executor.model_loader.utils``; no ``reload`` package: the release has
    no recorded checkpoint format, so the engine loads through the model's ``load_weights``)."""
    mod = types.ModuleType("vllm", f"vllm-ascend {release.version} stand-in (tests/ascend): not vLLM, not an NPU")
    mod.__path__ = []  # a package: its submodules come from sys.modules below
    mod.LLM = type("LLM", (LLM,), {"release": release})
    mod.SamplingParams = SamplingParams
    mod.__version__ = release.version
    out = {"vllm": mod}
    for name in ("vllm.model_executor", "vllm.model_executor.model_loader"):
        sub = types.ModuleType(name)
        sub.__path__ = []
        out[name] = sub
    utils = types.ModuleType("vllm.model_executor.model_loader.utils")
    utils.process_weights_after_loading = _process_weights_after_loading
    out[utils.__name__] = utils
    return out


def module(release: Release) -> types.ModuleType:
    """The ``vllm`` module standing for vllm-ascend ``release`` (see :func:`modules` for all of them)."""
    return modules(release)["vllm"]
