"""The ``hf`` rollout engine: batched sampling with a KV cache on the trainer's own model.

Colocated by construction: the engine holds a reference to the training model, so there is nothing to
sync after an update. Prompts are left-padded into one batch; the attention mask carries the padding and
``position_ids`` count real tokens only, so a padded prompt sees exactly what it would alone. A prompt that
appears several times in the batch (the n samples of one prompt in GRPO / DAPO / PPO) is prefilled once and its
KV cache rows copied to each of its samples (prefix sharing: the prefill costs the distinct prompts' tokens).
Every step feeds one token per row through the model's cache (transformers ``DynamicCache``); rows that stopped
keep decoding padding (cheaper than re-batching) and are cut off afterwards. The loop ends when every row has
stopped or ``max_tokens`` is reached.

``decode``: ``dynamic`` (the engine's default) as above; ``static`` and ``graph`` run the decode steps after the
prefill over a preallocated cache with fixed shapes, ``graph`` replaying one captured device graph per step (the
backend's ``device_graph``; polyrl.core.rollout.static_decode). The trainer passes ``rollout.decode``, whose
``auto`` it resolves to ``graph`` with ``graph_fallback="dynamic"`` where a graph can run
(polyrl.core.trainer.setup.decode_option).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from polyrl.core import distributed as D
from polyrl.core.models.lora import merged_for_generation
from polyrl.core.models.routing import replay_of
from polyrl.core.rollout.engine import RolloutOutput, SamplingParams
from polyrl.core.rollout.sampling import RowUniforms, sample_inverse_cdf
from polyrl.core.rollout.static_decode import MODES as DECODE_MODES
from polyrl.core.rollout.static_decode import StaticDecoder, slots_for


def filter_logits(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and outside the smallest set with probability >= top_p.

    logits: [B, V] fp32, already divided by the temperature. The most likely token always survives.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class HFEngine:
    name = "hf"
    # LoRA: generate with the adapters merged into the weights (one delta per weight per generate call instead
    # of one per forward; polyrl.core.models.lora.merged_for_generation), the base weights restored exactly after.
    merge_adapters = True

    def __init__(self, model: Any, *, pad_token_id: int, return_routes: bool = False, decode: str = "dynamic",
                 backend: Any = None, graph_fallback: str = "static", **_options: Any) -> None:
        # _options: what the trainer offers every engine (max_model_len, ...); the hf engine needs none.
        # backend: the model's backend; decode="graph" captures with its device graph (Backend.device_graph).
        # return_routes (rollout.routing_replay=r3): record the experts the routers chose, prefill and decode.
        # decode (rollout.decode): dynamic | static | graph (module docstring).
        # graph_fallback: how decode="graph" goes on after a failed capture: static (the step uncaptured) or
        # dynamic (rollout.decode: auto, which picked graph only because it is usually the fastest).
        if decode not in DECODE_MODES:
            raise ValueError(f"decode={decode!r}: expected one of {', '.join(DECODE_MODES)}")
        if graph_fallback not in ("static", "dynamic"):
            raise ValueError(f"graph_fallback={graph_fallback!r}: expected static or dynamic")
        if decode != "dynamic" and return_routes:
            raise ValueError(f"decode={decode!r} records no routes (the routers' hooks would run once, at capture); "
                             "routing replay r3 needs decode='dynamic'")
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.return_routes = bool(return_routes)
        self.decode = decode
        self.graph_fallback = graph_fallback
        self.capture = None
        if decode == "graph":
            capture = backend.device_graph() if backend is not None and hasattr(backend, "device_graph") else None
            if capture is None:
                where = f"backend {backend.name!r}" if backend is not None else "no backend given"
                raise ValueError(f"decode='graph' needs a backend that captures device graphs ({where} does not)")
            self.capture = capture
        # kept across calls, newest last: their buffers (and graphs) are reused; two shapes at most (a micro-batched
        # rollout has its full chunks and its last one)
        self._statics: list[StaticDecoder] = []

    def sync_weights(self, model: Any) -> None:
        self.model = model  # shared weights: nothing to copy

    def sleep(self) -> None:  # the engine is the trainer's model: nothing of its own to free
        pass

    def wake_up(self) -> None:
        pass

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        row_seeds: list[int] | None = None,
    ) -> RolloutOutput:
        """``row_seeds`` (one int per prompt): row i draws its uniforms from its own CPU generator seeded with
        ``row_seeds[i]`` (:mod:`polyrl.core.rollout.sampling`), so a row's response depends neither on which rows
        share its batch or rank nor on the device. Without ``row_seeds`` they are drawn from ``generator``."""
        if row_seeds is None:
            row_seeds = torch.randint(0, 2**62, (len(prompts),), generator=generator).tolist()
        chunk = params.micro_batch_size or len(prompts)
        out = RolloutOutput([], [], [], [] if self.return_routes else None)
        replay = replay_of(self.model)
        # LoRA: merged once for the whole call (every chunk), the base weights put back exactly after
        with merged_for_generation(self.model) if self.merge_adapters else contextlib.nullcontext():
            for start in range(0, len(prompts), chunk):
                # The routers' hooks (a model with routing replay installed) are told what this forward is: recorded
                # when the routes are to be returned, the model's own routing otherwise (never a replay left set).
                if replay is not None and self.return_routes:
                    replay.record()
                elif replay is not None:
                    replay.idle()
                try:
                    part = self._generate_batch(prompts[start : start + chunk], params,
                                                row_seeds[start : start + chunk])
                    if self.return_routes:
                        if replay is None:
                            raise ValueError("return_routes: the model has no routing replay installed "
                                             "(polyrl.core.models.routing.install_router_replay)")
                        out.routes += _split_routes(replay.recorded, prompts[start : start + chunk],
                                                    part.response_ids)
                finally:
                    if replay is not None:
                        replay.idle()
                out.response_ids += part.response_ids
                out.logprobs += part.logprobs
                out.finish_reasons += part.finish_reasons
        return out

    def _generate_batch(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
    ) -> RolloutOutput:
        from transformers import DynamicCache

        model = self.model
        device = next(model.parameters()).device
        B = len(prompts)
        S = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:
            raise ValueError("empty prompt")
        distinct, row_of = _distinct(prompts)
        U = len(distinct)
        ids = torch.full((U, S), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((U, S), dtype=torch.long)
        for i, p in enumerate(distinct):  # left padding: the last prompt token of every row is at S - 1
            ids[i, S - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, S - len(p) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [U, S]: 0 at each row's first real token
        expand = None if U == B else torch.tensor(row_of, dtype=torch.long, device=device)  # [B] -> prefill row
        stop = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=device)
        uniforms = RowUniforms(seeds, device, params.max_tokens)  # CPU generators: the same uniforms on every backend

        was_training = model.training
        model.eval()
        cache = DynamicCache(config=model.config)
        tokens = torch.empty((B, params.max_tokens), dtype=torch.long, device=device)
        logps = torch.zeros((B, params.max_tokens), dtype=torch.float32, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        lengths = torch.full((B,), params.max_tokens, dtype=torch.long, device=device)
        step_ids, step_pos = ids, positions
        static = None
        try:
            for t in range(params.max_tokens):
                if static is not None:  # a decode step over the static cache (S + t - 1 is this token's slot)
                    logits = static.forward(step_ids)
                else:
                    logits = model(
                        input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache,
                        use_cache=True,
                    ).logits[:, -1].float()  # [B, V] ([U, V] at the prefill)
                if t == 0 and expand is not None:  # each sample of a prompt gets that prompt's cache rows
                    logits, mask, step_pos = logits[expand], mask[expand], step_pos[expand]
                    cache.reorder_cache(expand)
                if t == 0 and self.decode != "dynamic" and params.max_tokens > 1:
                    static = self._static_decoder(model, B, slots_for(S, params.max_tokens))
                    static.load_prefill(cache, mask, step_pos)
                    cache = None  # the static cache holds the prompt now
                logits = logits / params.temperature
                logp_all = torch.log_softmax(logits, dim=-1)
                probs = torch.softmax(filter_logits(logits, params.top_p, params.top_k), dim=-1)
                nxt = sample_inverse_cdf(probs, uniforms.at(t))  # [B]
                nxt = torch.where(done, torch.full_like(nxt, self.pad_token_id), nxt)
                tokens[:, t] = nxt
                logps[:, t] = logp_all.gather(-1, nxt[:, None]).squeeze(-1)
                hit = ~done & torch.isin(nxt, stop) if stop.numel() else torch.zeros_like(done)
                lengths = torch.where(hit, torch.full_like(lengths, t + 1), lengths)
                done = done | hit
                if _all_ranks_done(done):
                    break
                step_ids = nxt[:, None]
                if static is None:
                    step_pos = step_pos[:, -1:] + 1
                    mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
        finally:
            model.train(was_training)
        if static is not None and static.capture_error and self.graph_fallback == "dynamic":
            self.decode, self.capture = "dynamic", None  # warned once by the decoder; its buffers are freed
            self._statics.clear()

        lengths_l = lengths.tolist()
        done_l = done.tolist()
        tok_l = tokens.tolist()
        lp_l = logps.tolist()
        return RolloutOutput(
            response_ids=[tok_l[i][: lengths_l[i]] for i in range(B)],
            logprobs=[lp_l[i][: lengths_l[i]] for i in range(B)],
            finish_reasons=["stop" if done_l[i] else "length" for i in range(B)],
        )


    @property
    def _static(self) -> StaticDecoder | None:
        """The static decoder used last (None before the first static decode)."""
        return self._statics[-1] if self._statics else None

    def _static_decoder(self, model: Any, batch: int, slots: int) -> StaticDecoder:
        """The engine's static decoder for this shape and model, reused (buffers, captured graph) when one of the
        last two shapes; otherwise the oldest is dropped first (two static caches alive at most)."""
        for i, dec in enumerate(self._statics):
            if dec.fits(model, batch, slots):
                self._statics.append(self._statics.pop(i))
                return dec
        if any(dec.capture_error for dec in self._statics):
            self.capture = None  # a capture failed on this engine (warned once): no new decoder tries again
        if len(self._statics) >= 2:
            self._statics.pop(0)
        self._statics.append(StaticDecoder(model, batch, slots, capture=self.capture, fallback=self.graph_fallback))
        return self._statics[-1]


def _distinct(prompts: list[list[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """The distinct prompts in order of first appearance, and for each row the index of its prompt among them."""
    first: dict[tuple[int, ...], int] = {}
    row_of = [first.setdefault(tuple(p), len(first)) for p in prompts]
    return list(first), row_of


def _split_routes(recorded: list[list[torch.Tensor]], prompts: list[list[int]],
                  responses: list[list[int]]) -> list[torch.Tensor]:
    """Per row, the experts of each token it ran, [P + R - 1, L, k] (RolloutOutput.routes), from the routers' record of
    one ``_generate_batch``: per layer, call 0 is the prefill of the distinct prompts ([U * S, k], row-major over the
    left-padded [U, S]; row i's prompt is ``_distinct(prompts)[1][i]``), call t >= 1 the decode step that ran
    response token t - 1 ([B, k])."""
    S = max(len(p) for p in prompts)
    distinct, row_of = _distinct(prompts)
    expand = torch.tensor(row_of, dtype=torch.long)
    per_layer = []
    for calls in recorded:  # one MoE layer
        prefill = calls[0].view(len(distinct), S, -1)[expand.to(calls[0].device)]  # [B, S, k]
        decode = torch.stack(calls[1:], dim=1) if len(calls) > 1 else prefill[:, :0]  # [B, steps, k]
        per_layer.append((prefill, decode))
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ran = max(0, len(r) - 1)  # the last sampled token is never run
        out.append(torch.stack([torch.cat([pre[i, S - len(p):], dec[i, :ran]]) for pre, dec in per_layer], dim=1))
    return [x.to("cpu", torch.int16) for x in out]


def _all_ranks_done(done: torch.Tensor) -> bool:
    """Stop decoding only when every rank's rows are done: under FSDP each forward is a collective, so
    all ranks must run the same number of decode steps."""
    flag = done.all().to(torch.float32)
    return bool(D.all_reduce_(flag, "min").item() == 1.0)
