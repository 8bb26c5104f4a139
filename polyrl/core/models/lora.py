"""LoRA adapters on a built causal LM, through peft: the adapters train, the base weights stay frozen.

Design choice: peft injects its LoRA layers *into* the model in place (``inject_adapter_in_model``): the trainer
keeps the same transformers model object (its forward, config, decoder layers, LM head, backend binding), so
FSDP2, the fused log-probs, the engines and checkpoints see an ordinary module whose parameter names gained
``.base_layer`` / ``.lora_A.default`` / ``.lora_B.default``. peft's ``target_parameters`` puts adapters on the
fused 3-D expert weights of the MoE families ([E, ...] ``gate_up_proj`` / ``down_proj``: peft's ``ParamWrapper``,
a per-expert low-rank delta added to the weight while the experts run).

- The reference policy is the same model with its adapters off (:func:`adapters_disabled`): peft's layers then
  run their base layer alone, so its log-probs are the base model's exactly, and no second copy is held.
- Generation on the trainer's own model (the hf engine) runs with the adapters merged into the weights
  (:func:`merged_for_generation`): each targeted weight is swapped for a merged copy for the generate call and
  the original tensor put back after, bit for bit (a subtraction would not give the base back exactly).
- An engine with its own weights (vLLM) receives the merged weights under the base model's names
  (:func:`merged_tensors`), so its exact in-place sync and its probe are unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from polyrl.core.errors import BadInputError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from polyrl.core.config.schema import LoraConfig

ADAPTER = "default"  # peft's adapter name: one adapter per model

# model_type -> (module-name suffixes of nn.Linear layers, parameter paths of 3-D expert weights).
# GPT-OSS: attention projections + the routed experts. DeepSeek-V3: MLA's projections (q_proj where
# q_lora_rank is null, else q_a_proj / q_b_proj) + the routed experts. Not the dense first layers' and the shared
# experts' gate_proj / up_proj / down_proj: peft (on transformers 5) rewrites any target named so on a DeepSeek-V3
# into the fused experts' gate_up_proj at twice the rank, dropping the linear layers themselves.
PRESETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gpt_oss": (("q_proj", "k_proj", "v_proj", "o_proj"),
                ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
    "deepseek_v3": (("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
                    ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
}


def lora_targets(lora: LoraConfig, model_type: str) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) for a model of ``model_type``: the preset's, then the recipe's."""
    preset = model_type if lora.preset == "auto" else lora.preset
    if preset == "none":
        modules, params = (), ()
    elif preset in PRESETS:
        modules, params = PRESETS[preset]
    else:
        raise BadInputError(f"model.lora.preset: no LoRA preset for model type {model_type!r} (presets: "
                            f"{', '.join(PRESETS)}); set model.lora.preset=none and name target_modules")
    modules = list(dict.fromkeys([*modules, *lora.target_modules]))
    params = list(dict.fromkeys([*params, *lora.target_parameters]))
    if params and lora.dropout:
        raise BadInputError(f"model.lora.dropout: must be 0 with target_parameters ({', '.join(params)}): peft's "
                            "adapters on expert weights have no dropout")
    return modules, params


def peft_config(lora: LoraConfig, model: nn.Module) -> Any:
    """peft's ``LoraConfig`` for ``model`` (its targets resolved against what the model has: a preset name the
    model lacks, e.g. DeepSeek's q_proj where q_lora_rank is set, is dropped; a recipe's that matches nothing is
    refused)."""
    from peft import LoraConfig as PeftLoraConfig

    model_type = getattr(getattr(model, "config", None), "model_type", "")
    modules, params = lora_targets(lora, model_type)
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if _is_linear(m)}
    found = [m for m in modules if m in linear or any(n.endswith("." + m) for n, _ in model.named_modules())]
    present = {n for n, _ in model.named_parameters()}
    found_params = [p for p in params if any(n == p or n.endswith("." + p) for n in present)]
    for name in lora.target_modules:
        if name not in found:
            raise BadInputError(f"model.lora.target_modules: {name!r} matches no linear layer of {model_type}")
    for name in lora.target_parameters:
        if name not in found_params:
            raise BadInputError(f"model.lora.target_parameters: {name!r} matches no parameter of {model_type}")
    if not found and not found_params:
        raise BadInputError(f"model.lora: no target of the preset matches {model_type}; name target_modules")
    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                          target_modules=found or None, target_parameters=found_params or None)


def _is_linear(module: nn.Module) -> bool:
    from torch import nn

    return isinstance(module, nn.Linear)


def apply_lora(model: nn.Module, lora: LoraConfig, *, low_cpu_mem_usage: bool = False) -> nn.Module:
    """Inject ``lora``'s adapters into ``model`` in place (peft), freeze everything else; returns ``model``.

    The adapters' initialisation draws from the global generator (peft: kaiming-uniform A, zero B), so the
    caller seeds it as for the rest of the build; B = 0 makes the adapted model start as the base model.
    ``low_cpu_mem_usage``: adapters on the meta device (peft), for a meta skeleton."""
    from peft import inject_adapter_in_model

    config = peft_config(lora, model)
    for p in model.parameters():
        p.requires_grad_(False)
    model = inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=low_cpu_mem_usage)
    for name, p in model.named_parameters():
        p.requires_grad_(_is_adapter(name))
    model.polyrl_lora = config  # what the export writes as adapter_config.json
    return model


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def has_adapters(model: Any) -> bool:
    return getattr(model, "polyrl_lora", None) is not None


def lora_layers(model: nn.Module) -> list[Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` running its base layers only (the reference policy), adapters back on after. peft's own
    switch (``enable_adapters``); it also drops and restores the adapters' ``requires_grad``."""
    layers = lora_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def _target_param(layer: Any) -> torch.Tensor:
    """The base weight a LoRA layer adapts: a linear layer's weight, or a ParamWrapper's expert parameter."""
    get_param = getattr(layer, "get_param", None)
    return get_param() if callable(get_param) else layer.get_base_layer().weight


def can_merge(model: nn.Module) -> bool:
    """Whether :func:`merged_for_generation` can merge in place: plain (unsharded) tensors. FSDP2's DTensor
    shards are gathered from FSDP2's own buffers, which a swapped tensor would not reach."""
    return has_adapters(model) and not any(hasattr(p, "to_local") for p in model.parameters())


@contextlib.contextmanager
def merged_for_generation(model: nn.Module) -> Iterator[bool]:
    """Adapters merged into the weights for the duration (peft's ``merge``, one delta per weight instead of one
    per forward); yields whether it merged. Each targeted weight's tensor is swapped for a merged copy and the
    original tensor put back after, so the base weights are bit-identical afterwards (peft's ``unmerge``
    subtracts, which rounds). Memory: one copy of the targeted weights while it lasts. Without adapters, or on a
    sharded model (:func:`can_merge`), does nothing (the adapters then run unmerged: the same function)."""
    import torch

    if not can_merge(model):
        yield False
        return
    layers = lora_layers(model)
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for layer in layers:
                param = _target_param(layer)
                saved.append((param, param.data))
                param.data = param.data.clone()
            for layer in layers:
                layer.merge(adapter_names=[ADAPTER])
        yield True
    finally:
        for param, data in saved:
            param.data = data
        for layer in layers:
            layer.merged_adapters.clear()


def merged_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state dict, adapters merged: ``tensors`` (name -> full tensor of ``model``'s state dict,
    e.g. gathered from FSDP2 shards) with each adapted weight replaced by ``W + scaling * delta`` under the
    base model's name, the adapters' own entries dropped and ``.base_layer`` taken out of the names. ``tensors``
    may be a part of the state dict holding whole LoRA layers (weight and adapters together)."""
    import torch

    out = dict(tensors)
    with torch.no_grad():
        for prefix, layer in model.named_modules():
            if not hasattr(layer, "lora_A") or ADAPTER not in layer.lora_A or f"{prefix}.lora_A.{ADAPTER}.weight" not in out:
                continue  # not a LoRA layer, or not among ``tensors`` (a bucket of some layers)
            a = out[f"{prefix}.lora_A.{ADAPTER}.weight"]
            b = out[f"{prefix}.lora_B.{ADAPTER}.weight"]
            scaling = layer.scaling[ADAPTER]
            pname = getattr(layer, "parameter_name", None)
            base = _innermost_prefix(prefix, layer) + "." + (pname or "weight")
            w = out[base]
            out[base] = (w.float() + _delta(layer, a.float(), b.float(), scaling, w.shape)).to(w.dtype)
    return {_base_name(n): t for n, t in out.items() if not _is_adapter(n)}


def _innermost_prefix(prefix: str, layer: Any) -> str:
    """The state-dict prefix of the module whose weight ``layer`` adapts (nested ParamWrappers: one
    ``.base_layer`` per level)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    node, name = layer, prefix
    while isinstance(node, BaseTunerLayer):
        node, name = node.base_layer, name + ".base_layer"
    return name


def _delta(layer: Any, a: torch.Tensor, b: torch.Tensor, scaling: float, shape: tuple[int, ...]) -> torch.Tensor:
    """``scaling * B @ A`` in the weight's layout: [out, in] for a linear layer; for a 3-D expert weight [E, d1, d2]
    peft stacks the experts' factors as A [r·E, in], B [out, r·E] (expert-minor in B), with (in, out) = (d1, d2)
    where the experts are stored transposed (``is_transposed``: GPT-OSS) and (d2, d1) otherwise."""
    import torch

    if len(shape) == 2:
        return (b @ a) * scaling
    experts = shape[0]
    a3 = a.reshape(experts, -1, a.shape[-1])  # [E, r, in]
    b3 = b.reshape(b.shape[0], -1, experts)  # [out, r, E]
    swapped = getattr(layer, "_did_swap_in_out_features", False)
    return torch.einsum("ore,eri->eoi" if swapped else "ore,eri->eio", b3, a3) * scaling


def _base_name(name: str) -> str:
    return name.replace(".base_layer", "")


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights under peft's saved names (``base_model.model.<module>.lora_A.weight``: what
    ``PeftModel.save_pretrained`` writes and ``PeftModel.from_pretrained`` and vLLM's LoRA loader read)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    return {"base_model.model." + name: t.detach().contiguous() for name, t in state.items()}


@dataclasses.dataclass(frozen=True)
class AdapterCount:
    """What ``model.lora`` adds to a model, in parameters (the memory plan's input)."""

    trainable: int  # the adapters' parameters: the only ones with gradients and optimizer states
    targeted: int  # the base weights they adapt (the hf engine's merged copy while it generates)
    experts_per_layer: int  # the largest decoder layer's adapted 3-D expert weights (materialised W + delta)


def adapter_count(model: nn.Module, lora: LoraConfig) -> AdapterCount:
    """Count ``lora``'s adapters on ``model`` (a meta-device model, left as it is: a copy gets the adapters,
    on meta, through peft's own target matching)."""
    import torch

    from polyrl.core.distributed.sharding import decoder_layers

    with torch.device("meta"):
        skeleton = apply_lora(copy.deepcopy(model), lora, low_cpu_mem_usage=True)
    layers = lora_layers(skeleton)
    experts = [sum(_target_param(m).numel() for m in lora_layers(layer) if _target_param(m).dim() == 3)
               for layer in decoder_layers(skeleton)]
    return AdapterCount(trainable=trainable_parameters(skeleton),
                        targeted=sum(_target_param(m).numel() for m in layers),
                        experts_per_layer=max(experts, default=0))
