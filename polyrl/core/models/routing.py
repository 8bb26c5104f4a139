"""Routing replay: record which experts an MoE model's routers pick, and force a recorded choice on a forward.

An MoE layer's router maps each token's hidden state to ``(logits, weights [T, k], indices [T, k])``; the experts
then run on ``indices`` weighted by ``weights`` (every experts path polyrl has — the reference, a backend's kernel,
expert parallelism's dispatch — consumes the router's output, so acting on the router acts on all of them).
:class:`RouterReplay` installs one forward hook on each router of a model, once, and is idle until asked:

- ``record()``: every router call appends its ``indices`` (the model's own choice) — the hf engine during
  generation, the trainer's old-log-prob pass for R2;
- ``force(routes)``: the router still computes its logits (so gradients reach it), but the experts are the
  given ones, and the weights are the model's own scores gathered at them with the family's normalisation:

  GPT-OSS (``GptOssTopKRouter``): ``weights = softmax(logits[idx])`` over the k selected logits;
  DeepSeek-V3 (``DeepseekV3TopkRouter``): ``s = sigmoid(logits)``, ``weights = s[idx] / sum(s[idx])`` (when
  ``norm_topk_prob``) ``* routed_scaling_factor``; the correction bias only ever enters the *selection*, so it
  has no part here.

  Given the model's own indices this is exactly (bitwise) the natural forward: the same values gathered, the same
  reductions (a token whose replayed *set* is the router's own keeps the router's order, so an engine that orders
  its k experts otherwise changes nothing either). A route entry of ``-1`` keeps the model's own choice for that
  token (padding, the last token of a sequence, which no engine ever ran).

Routes are [N, L, k] int over the N tokens of the forward as the routers see them (the flattened [B, T] input:
packed rows concatenated), L the model's MoE layers in order (:func:`moe_routers`), k its experts per token.
While forcing, each call also counts the tokens whose own top-k *set* differs from the forced one (the
``rollout/routing_mismatch`` metric: how much routing the replay changed).

Forcing stays in effect until the next ``force`` / ``record`` / ``idle`` call: activation checkpointing re-runs a
layer's forward during backward, after the forward returned, and must see the same routes (every caller of the
model's forward declares what it wants: ``policy_forward``, the hf engine). A forced call whose token count is not
the routes' raises: stale routes never silently route another batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# The router classes of the MoE families polyrl builds (transformers' modules), by family.
_ROUTERS = {"GptOssTopKRouter": "gpt_oss", "DeepseekV3TopkRouter": "deepseek_v3"}


def router_family(module: nn.Module) -> str | None:
    """``"gpt_oss"`` / ``"deepseek_v3"`` for a router this module knows how to replay, else None."""
    return _ROUTERS.get(type(module).__name__)


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of ``model``'s MoE layers, in layer order (module order: decoder layers come in order)."""
    return [m for m in model.modules() if router_family(m) is not None]


def moe_layer_ids(model: nn.Module) -> list[int]:
    """The decoder-layer index of each router of :func:`moe_routers` (``...layers.<i>...`` in its name): where an
    engine's per-layer routes for every decoder layer (dense ones included) keep the MoE layers' columns."""
    ids = []
    for name, m in model.named_modules():
        if router_family(m) is None:
            continue
        parts = name.split(".")
        at = [i for i, p in enumerate(parts[:-1]) if p == "layers" and parts[i + 1].isdigit()]
        if not at:
            raise ValueError(f"routing replay: cannot tell the decoder layer of router {name!r}")
        ids.append(int(parts[at[-1] + 1]))
    return ids


def unsupported_moe(model: nn.Module) -> str:
    """Why routing replay cannot run on ``model`` ("" when it can): no router it knows, or a router of a family
    it does not know (any module with a ``top_k`` and ``num_experts`` and a name saying router/gate)."""
    if moe_routers(model):
        return ""
    foreign = [type(m).__name__ for m in model.modules()
               if hasattr(m, "top_k") and hasattr(m, "num_experts") and router_family(m) is None]
    if foreign:
        return f"its router {foreign[0]} is not one routing replay knows (GPT-OSS, DeepSeek-V3)"
    return "it has no MoE layers"


def forced_weights(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The routing weights [T, k] of experts ``idx`` [T, k] from the router's own ``logits`` [T, E] (the family's
    normalisation, module docstring), in the dtype the router itself returns."""
    family = router_family(router)
    if family == "gpt_oss":
        sel = logits.gather(1, idx)
        return torch.nn.functional.softmax(sel, dim=1, dtype=sel.dtype)
    if family == "deepseek_v3":
        w = logits.sigmoid().gather(1, idx)
        if router.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * router.routed_scaling_factor
    raise TypeError(f"no routing replay for {type(router).__name__}")


def _differs(own: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """[T] bool: the top-k *sets* differ (order within a token's k does not matter)."""
    return (own.sort(dim=-1).values != used.sort(dim=-1).values).any(dim=-1)


class RouterReplay:
    """The hooks on every router of one model, and the mode they are in (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"routing replay: {unsupported_moe(model)}")
        self.top_k = int(self.routers[0].top_k)
        self.mode = "idle"  # idle | record | force
        self.recorded: list[list[torch.Tensor]] = [[] for _ in self.routers]  # per layer, per call: [T, k]
        self._routes: torch.Tensor | None = None  # [N, L, k] while forcing
        # (changed, forced) per forced call, 0-d tensors on the model's device: read (one host sync) by the properties
        self._counts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        model._polyrl_router_replay = self  # found again by replay_of()

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # --- modes ---------------------------------------------------------------------------------------
    def idle(self) -> None:
        self.mode, self._routes = "idle", None

    def record(self) -> None:
        """From now on every router call appends its own indices to ``recorded`` (cleared here)."""
        self.mode, self._routes = "record", None
        self.recorded = [[] for _ in self.routers]

    def force(self, routes: torch.Tensor) -> None:
        """From now on every router call routes its tokens by ``routes`` [N, L, k] (-1: the model's own)."""
        if routes.dim() != 3 or routes.shape[1:] != (self.num_layers, self.top_k):
            raise ValueError(f"routes must be [tokens, {self.num_layers}, {self.top_k}], got {list(routes.shape)}")
        self.mode, self._routes = "force", routes

    def reset_counts(self) -> None:
        self._counts = []

    @property
    def changed(self) -> int:
        """Tokens x layers forced to a set that is not the router's own, since ``reset_counts``."""
        return int(sum(c for c, _ in self._counts)) if self._counts else 0

    @property
    def forced(self) -> int:
        """Tokens x layers forced (route entries != -1), since ``reset_counts``."""
        return int(sum(f for _, f in self._counts)) if self._counts else 0

    def take_recorded(self) -> torch.Tensor:
        """[N, L, k] int16 on the host of the calls recorded so far, concatenated over calls (tokens in call order)."""
        per_layer = [torch.cat(calls) if calls else torch.zeros(0, self.top_k, dtype=torch.long)
                     for calls in self.recorded]
        self.recorded = [[] for _ in self.routers]
        return torch.stack(per_layer, dim=1).to("cpu", torch.int16)

    # --- the hook --------------------------------------------------------------------------------------
    def _hook(self, layer: int) -> Any:
        def hook(router: nn.Module, args: tuple, output: tuple) -> tuple | None:
            if self.mode == "idle":
                return None
            logits, _, own = output
            if self.mode == "record":
                self.recorded[layer].append(own.detach())  # on the device: no host sync per layer and step
                return None
            routes = self._routes
            if routes.shape[0] != own.shape[0]:
                raise RuntimeError(f"routing replay: the forward routes {own.shape[0]} tokens but the routes given "
                                   f"are for {routes.shape[0]} (stale routes from another batch?)")
            want = routes[:, layer].to(device=own.device, dtype=own.dtype)
            valid = (want >= 0).all(dim=-1)  # [T]
            differs = _differs(own, want) & valid
            # A token whose replayed set is the router's own keeps the router's order too: the experts then sum in
            # the natural order, so a replay that changes no set is the natural forward bit for bit.
            idx = torch.where(differs[:, None], want, own)
            self._counts.append((differs.sum(), valid.sum()))
            return logits, forced_weights(router, logits, idx), idx
        return hook


def replay_of(model: nn.Module) -> RouterReplay | None:
    """The :class:`RouterReplay` installed on ``model`` or on a module inside it (a wrapper: peft, a value head),
    None when none is."""
    for m in model.modules():
        found = m.__dict__.get("_polyrl_router_replay")
        if found is not None:
            return found
    return None


def install_router_replay(model: nn.Module) -> RouterReplay:
    """The replay of ``model``, installed once (idempotent)."""
    return replay_of(model) or RouterReplay(model)
