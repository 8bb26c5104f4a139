"""Static-shape decode steps for the hf engine (``rollout.decode: static | graph``).

The default decode (``dynamic``) feeds each token through transformers' ``DynamicCache``: every step concatenates
the keys and values, grows the padding mask, builds the masks anew and asks the device whether the mask is all
true. Those shapes change every step, and those host reads stall the host on the device. Such a step cannot be
captured in a CUDA graph.

Here the prefill still runs as in the dynamic decode (same forward, same numbers). Its cache is then copied into
preallocated buffers of L slots per row (a transformers ``Cache`` of ``StaticLayer``: the keys of step t are
written in place at slot S + t - 1). Every decode step after that has the same shapes and the same tensors:

- input ids [B, 1] and positions [B, 1], rewritten in place;
- the slot of the step's query (a 0-dim device tensor, advanced in place);
- the masks the attention function reads instead of transformers' (polyrl.core.attention.hf.static_decode):
  ``full`` = the row's real slots up to the query's slot, and per sliding window W the same cut to the W most
  recent slots. Computed in the step from the prompt's padding and the slot: the decode kernel then runs with
  no window and no "queries at the end of the keys" assumption;
- the logits [B, V] in fp32, written in place.

So the step reads no tensor value on the host and can be captured: ``graph`` captures it with the backend's
device graph (``Backend.device_graph()``: CUDA graphs on the cuda backend) once per (batch, slots, model weights)
and replays it for every token (one graph launch instead of hundreds of kernel launches and the Python of
transformers' modules). ``static`` runs the same step without capture, on any device. That is how the CPU tests
check it against the dynamic decode.

What changes numerically against ``dynamic``: nothing in the prefill, the sampling and the MoE. The decode
attention reduces over L slots, where masked slots add exact zeros, instead of the dynamic cache's length, so its
sums may round differently in the last bits (the tests bound it). Not supported, and refused at load: routing
replay r3 (the routers' recording hooks would run once, at capture), more than one process (FSDP2 gathers weights
inside the forward), engines other than hf.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from polyrl.core.attention.hf import StaticDecodeMasks, static_decode

MODES = ("dynamic", "static", "graph")
SLOT_ROUND = 16  # slots per row rounded up to a multiple of this: fewer distinct shapes, hence fewer captures


def slots_for(prompt_len: int, max_tokens: int) -> int:
    """Cache slots a row needs: the prompt and every generated token but the last (never fed back), rounded up."""
    need = prompt_len + max(max_tokens - 1, 1)
    return -(-need // SLOT_ROUND) * SLOT_ROUND


def _sliding_windows(config: Any) -> tuple[int, ...]:
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ()
    return (int(window),) if window and any("sliding" in str(t) for t in types) else ()


def _raised_at(exc: BaseException) -> str:
    """`` at file:line (function)`` of the innermost frame outside torch and this module: the model's or polyrl's
    line whose op could not be captured."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename and f.filename != __file__]
    if not frames:
        return ""
    f = frames[-1]
    parts = f.filename.replace("\\", "/").split("/")
    return f" at {'/'.join(parts[-2:])}:{f.lineno} ({f.name})"


def _weights_key(model: torch.nn.Module) -> tuple:
    """What a captured graph depends on besides its own buffers: the weights' storage. The optimizer updates them in
    place (same storage); a LoRA merge swaps in merged copies (new storage: a new capture)."""
    return tuple(p.data_ptr() for p in model.parameters()) + tuple(b.data_ptr() for b in model.buffers())


class StaticDecoder:
    """One static cache and its decode step for ``batch`` rows of ``slots`` cache slots (module docstring).

    Use: :meth:`load_prefill` once per generate call (after the dynamic prefill and the expansion of the distinct
    prompts to their samples), then :meth:`forward` once per decode step with the tokens sampled last; it returns
    the fp32 logits [B, V] of the step (a buffer overwritten by the next step)."""

    def __init__(self, model: torch.nn.Module, batch: int, slots: int, *, capture: Any = None,
                 fallback: str = "static") -> None:
        """``capture``: the backend's graph capture (``Backend.device_graph()``) to replay each step as one device
        graph, or None to run the step as it is. ``fallback``: how the engine decodes after a failed capture
        (``static`` or ``dynamic``; named in the warning)."""
        from transformers.cache_utils import Cache, StaticLayer

        device = next(model.parameters()).device
        self.model, self.batch, self.slots, self.capture, self.fallback = model, batch, slots, capture, fallback
        n_layers = int(model.config.num_hidden_layers)
        self.cache = Cache(layers=[StaticLayer(max_cache_len=slots) for _ in range(n_layers)])
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.slot = torch.zeros((), dtype=torch.long, device=device)
        self.slot_range = torch.arange(slots, device=device)
        self.real = torch.zeros((batch, slots), dtype=torch.bool, device=device)  # prompt padding False
        full = torch.zeros((batch, slots), dtype=torch.bool, device=device)
        windowed = {w: torch.zeros_like(full) for w in _sliding_windows(model.config)}
        self.masks = StaticDecodeMasks(full, windowed, self.slot, self.slot_range)
        self.logits: torch.Tensor | None = None
        self.replay: Any = None
        self.graph_weights: tuple | None = None
        self.captures = 0  # graphs captured over this decoder's life (the tests count them)
        self.capture_error: str | None = None  # why the capture failed (then the step runs uncaptured)
        self.weights_checked = False

    def fits(self, model: torch.nn.Module, batch: int, slots: int) -> bool:
        return model is self.model and batch == self.batch and slots == self.slots

    def load_prefill(self, cache: Any, mask: torch.Tensor, positions: torch.Tensor) -> None:
        """Take over a dynamic prefill: ``cache`` (transformers DynamicCache, already expanded to B rows) holds the
        S prompt slots (a sliding layer only its most recent ones); ``mask`` [B, S] the prompt's padding;
        ``positions`` [B, S] the prefill's position ids."""
        S = mask.shape[1]
        if self.slots < S + 1:
            raise ValueError(f"static decode: {S} prompt slots leave no room in {self.slots}")
        for layer, src in zip(self.cache.layers, cache.layers, strict=True):
            k, v = src.keys, src.values  # [B, H, n, D], n = S (a sliding layer: its window's last n <= S)
            if not layer.is_initialized:
                layer.lazy_initialization(k[:, :, :1], v[:, :, :1])
            n = k.shape[2]
            layer.keys[:, :, S - n : S].copy_(k)
            layer.values[:, :, S - n : S].copy_(v)
            layer.cumulative_length.fill_(S)
        self.real[:, :S].copy_(mask.to(torch.bool))
        self.real[:, S:] = True
        self.slot.fill_(S)
        self.pos.copy_(positions[:, -1:] + 1)  # the first fed token follows the prompt's last position
        self.weights_checked = False  # weights change between generate calls only: checked at the first step

    def _step(self) -> None:
        """The captured part: masks from the slot, one forward over the static cache, the last position's logits."""
        # the warm-up and the capture run this step; after a failed capture it runs uncaptured, on cheaper paths
        self.masks.capturable = self.capture is not None
        full = self.real & (self.slot_range <= self.slot)
        self.masks.full.copy_(full)
        for w, m in self.masks.windowed.items():
            m.copy_(full & (self.slot_range > self.slot - w))
        with static_decode(self.masks):
            out = self.model(input_ids=self.ids, position_ids=self.pos, past_key_values=self.cache,
                             use_cache=True).logits[:, -1]
        if self.logits is None:
            self.logits = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        self.logits.copy_(out)

    def _capture(self) -> None:
        """Capture :meth:`_step` with the backend's device graph. Its warm-up run writes this step's keys and
        advances the layers' counters; they are put back before the capture (the slot is rewritten by the first
        replay, which is the real step: capturing runs nothing)."""
        lengths = [layer.cumulative_length.clone() for layer in self.cache.layers]

        def restore() -> None:
            for layer, n in zip(self.cache.layers, lengths):
                layer.cumulative_length.copy_(n)
        try:
            self.replay = self.capture(self._step, restore)
        except Exception as exc:
            restore()  # a capture records and runs nothing; the warm-up's writes are undone either way
            why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            self.capture_error = f"{type(exc).__name__}: {why}{_raised_at(exc)}"
            warnings.warn(f"rollout.decode=graph: capturing the decode step failed ({self.capture_error}); this "
                          f"engine decodes without a graph from now on (as rollout.decode={self.fallback})",
                          RuntimeWarning,
                          stacklevel=3)
            self.capture = None
            return
        self.graph_weights = _weights_key(self.model)
        self.captures += 1

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """One decode step feeding ``ids`` [B] or [B, 1] at the current slot; returns the logits buffer [B, V]."""
        self.ids.copy_(ids.view(self.batch, 1))
        if self.capture is not None and not self.weights_checked:
            if self.replay is None or self.graph_weights != _weights_key(self.model):
                self._capture()
            self.weights_checked = True
        if self.capture is not None:
            self.replay()
        else:
            self._step()
        self.slot.add_(1)
        self.pos.add_(1)
        return self.logits
