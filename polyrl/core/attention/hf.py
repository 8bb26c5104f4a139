"""The transformers attention implementation ``"polyrl"``: attention function AND mask function.

``from_pretrained(..., attn_implementation="polyrl")`` then runs every causal LM transformers supports
(GPT-OSS with sinks and sliding windows, DeepSeek-V3 MLA with Dv != D, Llama, Qwen, ...) through
:func:`polyrl.core.attention.varlen_attention` for training and :func:`decode_attention` for generation.

Registration is cheap and lazy: ``import polyrl`` must not import transformers (seconds), so
:func:`register` registers at once what transformers has already loaded and otherwise leaves an import
hook that registers right after ``transformers.modeling_utils`` (attention function) and
``transformers.masking_utils`` (mask function) finish loading. The hook only calls transformers' public
``register`` API; it patches nothing.

Why a mask function: transformers only builds a mask for implementations it knows; without one, the
attention function silently receives ``attention_mask=None`` and padding is lost. Ours returns the 2-D
key padding mask ``bool [B, kv_len]`` sliced to the keys the layer receives (or None when nothing is
padded): linear in tokens, unlike eager's [B, 1, Sq, Sk] float mask.

How a call is routed (q_len = Sq, k_len = Sk):
- Sq == Sk, no padding: training layout. Documents are the batch rows, split further where
  ``position_ids`` do not increase by one (packed documents restarting at 0), or given explicitly by the
  ``cu_seq_lens_q`` kwarg (transformers' flattening collator). -> varlen_attention.
- Sq == Sk with padding whose real tokens are contiguous in each row (left or right padding): the real
  tokens are gathered into documents -> varlen_attention; padded positions return zeros.
- otherwise (Sq < Sk: generation with a KV cache; or holes in the padding): queries at the end of the keys
  -> decode_attention with the padding mask. Static caches (keys not ending at the queries) are refused, except
  inside :func:`static_decode` (the hf engine's static decode step, polyrl.core.rollout.static_decode): there the
  step's own masks, which already hold the causal limit and the window, replace transformers' mask, and nothing
  reads a tensor value on the host (the step can be captured in a CUDA graph).
The mask function's pattern (sliding window, packing) is not read: the window comes from the
``sliding_window`` kwarg and packing from ``position_ids``; models needing other patterns (chunked or
bidirectional attention) are not supported.

Which backend runs the packed and the decode attention is the model's, not the process's: :func:`bind_backend`
(called by ``polyrl.core.models.build_model``) stores the backend on every module of the model, and the attention
function reads it from the module transformers hands it (``Backend.varlen_attention`` for the packed paths,
``Backend.decode_attention`` for generation). Two models bound to two backends therefore run side by side in
one process. A model loaded with ``attn_implementation="polyrl"`` outside ``build_model`` and never bound runs
on the process's active backend, as a direct call of ``varlen_attention`` does.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from polyrl.core.plugins.backend import Backend

NAME = "polyrl"
# The module attribute holding a model's backend binding (one _Binding shared by all of the model's modules).
_BINDING_ATTR = "_polyrl_attention_backend"


# --------------------------------------------------------------------------------------------------
# the backend of a model


class _Binding:
    """A model's backend, shared by all its modules. Copying the model (``copy.deepcopy`` of the actor makes the
    reference model) shares it too: a backend is a process-wide object, never duplicated."""

    __slots__ = ("backend",)

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def __copy__(self) -> _Binding:
        return self

    def __deepcopy__(self, memo: dict) -> _Binding:
        return self


def bind_backend(model: Any, backend: Backend) -> None:
    """Run every ``"polyrl"`` attention call of ``model`` on ``backend`` from now on (rebinding replaces the
    previous backend). Every submodule gets the binding: transformers hands the attention function the module
    that calls it, whichever class that is."""
    binding = _Binding(backend)
    for module in model.modules():
        setattr(module, _BINDING_ATTR, binding)


def bound_backend(module: Any) -> Backend | None:
    """The backend ``module`` was bound to by :func:`bind_backend`, or None."""
    binding = getattr(module, _BINDING_ATTR, None)
    return binding.backend if binding is not None else None


# --------------------------------------------------------------------------------------------------
# the static decode step (polyrl.core.rollout.static_decode)

_STATIC_DECODE: Any = None  # the StaticDecodeMasks of the step running now, or None


class StaticDecodeMasks:
    """What a static decode step hands the attention function: ``full`` bool [B, L], the cache slots each row's
    query sees (real tokens up to the query's own slot), and ``windowed`` {W: bool [B, L]}, the same cut to the W
    most recent slots. Built and updated by the step (no host reads); a window not precomputed is derived on the
    fly from ``slot`` (0-dim long, the query's slot) and ``slots`` (arange(L)). ``capturable``: the step is run to
    be captured in a device graph (``rollout.decode: graph``), so the model's layers must take paths without host
    reads or data-dependent shapes even where those cost more (polyrl.core.models.experts)."""

    __slots__ = ("capturable", "full", "slot", "slots", "windowed")

    def __init__(self, full: torch.Tensor, windowed: dict[int, torch.Tensor], slot: torch.Tensor,
                 slots: torch.Tensor, capturable: bool = False) -> None:
        self.full, self.windowed, self.slot, self.slots = full, windowed, slot, slots
        self.capturable = capturable

    def mask_for(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.full
        if window not in self.windowed:
            return self.full & (self.slots > self.slot - window)
        return self.windowed[window]


def static_decode_masks() -> StaticDecodeMasks | None:
    """The masks of the static decode step running now (:func:`static_decode`), or None outside one."""
    return _STATIC_DECODE


class static_decode:
    """``with static_decode(masks):`` the model's ``"polyrl"`` attention calls read their masks from ``masks``
    (one decode query per row over a static cache) and the mask function returns None without looking at the
    cache. Not re-entrant; one at a time per process."""

    def __init__(self, masks: StaticDecodeMasks) -> None:
        self.masks = masks

    def __enter__(self) -> StaticDecodeMasks:
        global _STATIC_DECODE
        if _STATIC_DECODE is not None:
            raise RuntimeError("static_decode is not re-entrant")
        _STATIC_DECODE = self.masks
        return self.masks

    def __exit__(self, *exc: Any) -> None:
        global _STATIC_DECODE
        _STATIC_DECODE = None


# --------------------------------------------------------------------------------------------------
# the mask function


def polyrl_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Key padding mask bool [B, kv_length] for the keys the layer will receive, or None if none is padded.
    Inside :func:`static_decode`: None at once (the attention function takes the step's own masks)."""
    import torch

    if _STATIC_DECODE is not None:
        return None
    q_offset = int(q_offset)
    if q_offset - kv_offset != kv_length - q_length:
        raise NotImplementedError(
            f"attn_implementation={NAME!r} needs the queries at the end of the keys (a dynamic cache); got "
            f"query offset {q_offset - kv_offset} in {kv_length} keys for {q_length} queries (static cache?)"
        )
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)
    if mask.dim() != 2:
        raise ValueError(f"attn_implementation={NAME!r} takes a 2-D padding mask, got shape {tuple(mask.shape)}")
    if mask.shape[-1] < kv_offset + kv_length:  # keys beyond the mask (static caches pad with False)
        mask = torch.nn.functional.pad(mask, (0, kv_offset + kv_length - mask.shape[-1]))
    mask = mask[:, kv_offset : kv_offset + kv_length]
    if bool(mask.all()):
        return None
    return mask


# --------------------------------------------------------------------------------------------------
# the attention function


def _cu_from_positions(position_ids: torch.Tensor | None, b: int, s: int, device) -> torch.Tensor:
    """Document starts of the flattened [B * S] tokens: each row, split where positions do not step by 1."""
    import torch

    starts = torch.zeros(b, s, dtype=torch.bool, device=device)
    starts[:, 0] = True
    if position_ids is not None and s > 1:
        pos = position_ids.to(device).expand(b, s)
        starts[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
    idx = starts.flatten().nonzero().flatten()
    return torch.cat([idx, idx.new_tensor([b * s])]).to(torch.int32)


def _contiguous_rows(mask: torch.Tensor) -> bool:
    """Are the real tokens of every row one contiguous run (left or right padding)?"""
    m = mask.long()
    # A single run has two edges, counting the row's ends as edges when the run touches them.
    edges = (m[:, 1:] != m[:, :-1]).sum(dim=1) + m[:, 0] + m[:, -1]
    return bool((edges <= 2).all())


def polyrl_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query [B, Hq, Sq, D], key [B, Hkv, Sk, D], value [B, Hkv, Sk, Dv]
    -> (out [B, Sq, Hq, Dv], None)."""
    import torch

    from polyrl.core.attention.op import decode_attention, varlen_attention

    if dropout:
        raise ValueError(f"attn_implementation={NAME!r} has no attention dropout (got {dropout}); set it to 0")
    if not getattr(module, "is_causal", True):
        raise ValueError(f"attn_implementation={NAME!r} is causal only; {type(module).__name__} is not causal")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"attn_implementation={NAME!r} expects the 2-D padding mask of its own mask function, got a "
            f"{attention_mask.dim()}-D mask (a custom 4-D mask is not supported)"
        )
    backend = bound_backend(module)  # None: never bound, the process's active backend
    b, hq, sq, d = query.shape
    sk, dv = key.shape[2], value.shape[3]
    window = int(sliding_window) if sliding_window else None
    scale = float(scaling) if scaling is not None else d**-0.5
    q = query.transpose(1, 2)  # [B, Sq, Hq, D]
    k = key.transpose(1, 2)  # [B, Sk, Hkv, D]
    v = value.transpose(1, 2)  # [B, Sk, Hkv, Dv]

    if sq == sk and attention_mask is None:
        if cu_seq_lens_q is not None:
            if b != 1:
                raise ValueError(f"cu_seq_lens_q describes a packed batch of one row, got batch size {b}")
            # identity first: comparing values of device tensors would stall the host in every layer
            if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q and not torch.equal(
                    cu_seq_lens_k.cpu(), cu_seq_lens_q.cpu()):
                raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q (self-attention over packed documents)")
            cu = cu_seq_lens_q.to(device=q.device, dtype=torch.int32)
        else:
            cu = _cu_from_positions(position_ids, b, sq, q.device)
        out = varlen_attention(
            q.reshape(b * sq, hq, d),
            k.reshape(b * sk, -1, d),
            v.reshape(b * sk, -1, dv),
            cu,
            scale=scale,
            window=window,
            sinks=s_aux,
            backend=backend,
        )
        return out.view(b, sq, hq, dv), None

    if sq == sk and _contiguous_rows(attention_mask):
        # Padded batch without cache (e.g. logprobs of a padded batch): gather the real tokens as documents.
        flat = attention_mask.flatten()
        idx = flat.nonzero().flatten()
        lengths = attention_mask.sum(dim=1)
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
        out_real = varlen_attention(
            q.reshape(b * sq, hq, d)[idx],
            k.reshape(b * sk, -1, d)[idx],
            v.reshape(b * sk, -1, dv)[idx],
            cu,
            scale=scale,
            window=window,
            sinks=s_aux,
            backend=backend,
        )
        out = out_real.new_zeros(b * sq, hq, dv).index_copy(0, idx, out_real)
        return out.view(b, sq, hq, dv), None

    # Generation: the bound (or active) backend's decode kernel, as the packed paths above run its varlen one.
    if _STATIC_DECODE is not None and sq < sk:  # a static cache: the step's mask holds causality and the window
        attention_mask, window = _STATIC_DECODE.mask_for(window), None
    out = decode_attention(q, k, v, key_padding_mask=attention_mask, scale=scale, window=window, sinks=s_aux,
                           backend=backend)
    return out, None


# --------------------------------------------------------------------------------------------------
# registration


def _register_attention_function(modeling_utils: Any) -> None:
    modeling_utils.AttentionInterface.register(NAME, polyrl_attention_forward)


def _register_mask_function(masking_utils: Any) -> None:
    masking_utils.AttentionMaskInterface.register(NAME, polyrl_attention_mask)


_TARGETS = {
    "transformers.modeling_utils": ("AttentionInterface", _register_attention_function),
    "transformers.masking_utils": ("AttentionMaskInterface", _register_mask_function),
}


class _RunAfterLoad(importlib.abc.Loader):
    """Wraps a module's loader: executes the module, then calls ``callback(module)``."""

    def __init__(self, loader: Any, callback: Any) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        try:
            self._callback(module)
        except Exception as exc:  # never break the transformers import itself
            warnings.warn(f"polyrl: could not register attention {NAME!r}: {exc}", stacklevel=2)

    def __getattr__(self, name: str):  # get_data, get_resource_reader, ... of the real loader
        return getattr(self._loader, name)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the "polyrl" functions right after the transformers module holding each interface loads."""

    def __init__(self) -> None:
        self.pending: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    self.pending.discard(fullname)
                    spec.loader = _RunAfterLoad(spec.loader, _TARGETS[fullname][1])
                return spec
        return None


_hook = _RegisterOnImport()


def register() -> None:
    """Register ``"polyrl"`` in transformers now for what is loaded, at import time for the rest."""
    for modname, (attr, callback) in _TARGETS.items():
        module = sys.modules.get(modname)
        if module is not None and hasattr(module, attr):
            callback(module)
        else:
            _hook.pending.add(modname)
    if _hook.pending and _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


def is_registered() -> bool:
    """True when both the attention and the mask function are registered (imports transformers)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    return NAME in AttentionInterface._global_mapping and NAME in AttentionMaskInterface._global_mapping
