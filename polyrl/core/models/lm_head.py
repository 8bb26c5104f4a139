"""Per-token log-probs and entropy of a causal LM without its [T, V] logits: the fused lm_head path.

The trainer needs log softmax(lm_head(h)/τ) at the response positions only, and their entropy. Asking the model
for ``.logits`` materialises [T, V] (13 GB in fp32 at 16k tokens and GPT-OSS's 201088-token vocabulary, and its
gradient again). Here the model runs its usual forward with ``logits_to_keep`` = no position (its lm_head then
multiplies a [b, 0, H] slice), a forward hook on the base model takes the last hidden states (after the final
norm) and hands the selected rows, with the lm_head weight and bias, to the backend's ``linear_logprobs`` kernel
(polyrl.core.algorithms.linear_logprobs for the contract).

The kernel runs *inside* the model's forward (in the hook), where a sharded model's root parameters — the
lm_head among them under FSDP2 — are gathered, and its results leave as part of the forward's output (the
model returns (output, (logp, entropy)) while the hooks are on), so that FSDP2 gathers those parameters again
before their backward exactly as it would for the logits.
Works for any transformers causal LM whose forward takes ``logits_to_keep`` and whose output embedding is a
plain ``nn.Linear`` applied to the base model's output (GPT-OSS, DeepSeek-V3, Llama, Qwen, ...); a model that
post-processes its logits (soft-capping, scaling) is refused by :func:`fused_head_problem`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

# Config fields that transform the logits after lm_head (Gemma's soft-capping, Cohere's logit_scale, ...).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "output_multiplier_scale")


def fused_head_problem(model: torch.nn.Module) -> str:
    """Why ``model`` cannot run the fused path ("" when it can)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Linear):
        return f"{type(model).__name__} has no nn.Linear output embedding (lm_head)"
    base = getattr(model, "base_model", model)
    if base is model:
        return f"{type(model).__name__} has no separate base model to take the hidden states from"
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return f"{type(model).__name__}.forward takes no logits_to_keep"
    config = getattr(model, "config", None)
    for key in _LOGIT_TRANSFORMS:
        value = getattr(config, key, None)
        if value not in (None, 0, 1, 1.0, False):
            return f"its config sets {key}={value} (the logits are transformed after lm_head)"
    return ""


def fused_logprobs(
    model: torch.nn.Module,
    kwargs: dict[str, Any],
    gather: torch.Tensor,
    labels: torch.Tensor,
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    *,
    chunk_size: int,
    temperature: float,
    compute_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) fp32 [N] of ``labels`` at the flat positions ``gather`` of the model's input.

    ``kwargs``: the model's inputs ([b, L] ids, packed or padded); ``gather``: [N] indices into the flattened
    [b·L] positions whose next token is ``labels`` [N]; ``kernel``: ``Backend.linear_logprobs``.
    """
    head = model.get_output_embeddings()
    result: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_base_output(module: torch.nn.Module, args: Any, output: Any) -> None:
        hidden = output[0]  # last_hidden_state [b, L, H], after the final norm
        sel = hidden.reshape(-1, hidden.shape[-1]).index_select(0, gather)  # [N, H]: response positions only
        result.append(kernel(sel, head.weight, labels, bias=head.bias, chunk_size=chunk_size,
                             temperature=temperature, compute_entropy=compute_entropy))

    def on_model_output(module: torch.nn.Module, args: Any, output: Any) -> Any:
        # Hand the results out *as outputs of the model's forward*: a sharded model (FSDP2) registers its
        # pre-backward hook, which gathers the root parameters (the lm_head weight) again before backward, on
        # the tensors its forward returns (it walks tuples, and only the declared fields of a ModelOutput).
        # Prepended, so this runs before that post-forward hook; the caller unpacks the pair.
        return output, tuple(result[0]) if len(result) == 1 else ()

    handles = [model.base_model.register_forward_hook(on_base_output),
               model.register_forward_hook(on_model_output, prepend=True)]
    try:
        none = torch.empty(0, dtype=torch.long, device=gather.device)
        _, fused = model(**kwargs, use_cache=False, logits_to_keep=none)  # lm_head sees [b, 0, H]: no logits
    finally:
        for handle in handles:
            handle.remove()
    if len(result) != 1:
        raise RuntimeError(f"the base model of {type(model).__name__} ran {len(result)} times in one forward")
    return fused


# "auto" fuses from this vocabulary size up: below it the [T, V] logits are small (a few MB at the tiny
# recipes' 17 tokens), the logits path is as fast, and a fused kernel's first compile (tens of seconds for
# Triton's forward and backward) would dominate a short run's start-up.
AUTO_MIN_VOCAB = 32768


def _vocab_size(model: torch.nn.Module) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None:
        return int(weight.shape[0])
    return int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)


def uses_fused_logprobs(setting: bool | str, model: torch.nn.Module) -> bool:
    """Does ``model.fused_logprobs`` = ``setting`` fuse the lm_head into the log-prob for ``model``? The one rule,
    read by the trainer and by the dry-run plan (on a meta-device model). "auto": where the model allows it and
    its vocabulary is large enough for the logits to matter (``AUTO_MIN_VOCAB``); true: fused, or a BadInputError
    naming why not; false: never."""
    if setting is False or setting == "false":
        return False
    if setting == "auto" and _vocab_size(model) < AUTO_MIN_VOCAB:
        return False
    problem = fused_head_problem(model)
    if problem:
        if setting is True or setting == "true":
            from polyrl.core.errors import BadInputError

            raise BadInputError(f"model.fused_logprobs=true: {problem}; set model.fused_logprobs to auto or false")
        return False
    return True


def uses_fused_loss(setting: bool | str, fused_path: bool, backend: Any) -> bool:
    """Does ``model.fused_loss`` = ``setting`` take the actor loss's gradient inside the fused op? The one rule, read
    by the trainer and by the dry-run plan. ``fused_path``: :func:`uses_fused_logprobs` said yes. "auto": on the
    fused path, where the backend provides its own ``linear_logprob_loss`` kernel (the core reference recomputes each
    chunk's logits: its value is the semantics, it saves nothing); true: on the fused path, or a BadInputError
    naming why not; false: never."""
    if setting is False or setting == "false":
        return False
    if not fused_path:
        if setting is True or setting == "true":
            from polyrl.core.errors import BadInputError

            raise BadInputError("model.fused_loss=true needs the fused log-prob path, and model.fused_logprobs runs "
                                "the logits path for this model; set model.fused_logprobs=true (or "
                                "model.fused_loss=false)")
        return False
    if setting == "auto":
        return not backend.is_reference and "linear_logprob_loss" in backend.introspection.provided_kernels()
    return True


def fused_kernel_for(setting: bool | str, model: torch.nn.Module, backend: Any) -> Callable[..., Any] | None:
    """The ``linear_logprobs`` kernel to use for ``model`` under ``model.fused_logprobs`` = ``setting``, or None
    (the logits path): ``backend.linear_logprobs`` where :func:`uses_fused_logprobs` says so."""
    return backend.linear_logprobs if uses_fused_logprobs(setting, model) else None
