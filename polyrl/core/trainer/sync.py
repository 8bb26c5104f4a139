"""Weight sync into the rollout engine, verified: never generate from a stale policy.

After every update the trainer hands its weights to the engine (``engine.sync_weights``). An engine that holds
its own copy (``is_verified``: vLLM) is then checked, in prefill and in decode: it scores a fixed probe batch
(``score``, the prefill path) and samples past the sliding window (``decode_probe_diff``, the decode path: another
kernel, and for MLA other weights), and its per-token log-probs are compared with the trainer's own on the same
tokens. Beyond the tolerance (``rollout.sync_probe`` for the lower of the trainer's and the engine's precision, in
polyrl.core.tolerances) the run stops (``SyncFailed``, one line with the measured difference): a stale or
half-loaded engine (experts or sinks not updated, a partial load, decode weights not rebuilt, an inference kernel
with another sliding-window convention) would otherwise train on samples from a policy that is not the one being
optimised. There is no repair in-process: the same fault would recur at the next sync, and vLLM's sleep-mode
allocator refuses a second engine in one process; the run directory stays resumable.

The probe: sequences of pseudo-random tokens (a fixed seed: the same probe every step), one short, and for a
model with sliding-window layers one longer than the window by half a window, so the check covers the
sliding layers beyond the window edge as well as the full ones. The decision uses the largest difference over
all ranks (each rank checks its own engine), so every rank stops alike.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from polyrl.core import distributed as D
from polyrl.core.rollout import is_verified
from polyrl.core.tolerances import tolerance
from polyrl.core.trainer.batch import SequenceBatch, policy_forward
from polyrl.core.trainer.experience import TrainingAborted


class SyncFailed(TrainingAborted):
    """The engine's log-probs differ from the trainer's after a sync: the message says by how much and why. The
    run directory is intact: the guard adds where the same command resumes (polyrl.core.run.guard)."""

    resumable = True


def probe_sequences(config: Any, vocab_size: int, *, max_len: int, seed: int = 1234) -> list[list[int]]:
    """Token sequences to verify a sync on: a short one and, with sliding-window layers, one past the window."""
    window = getattr(config, "sliding_window", None)
    lengths = [min(12, max_len)]
    if window:
        lengths.append(min(int(window) + max(int(window) // 2, 4), max_len))
    gen = torch.Generator().manual_seed(seed)
    low = min(4, vocab_size - 1)  # skip the tiny tokenizer's specials (<pad>, <bos>, <eos>, <unk>)
    return [torch.randint(low, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def trainer_logprobs(model: Any, sequences: list[list[int]], *, packed: bool, pad_id: int, chunk_size: int,
                     logprobs: Any, linear_logprobs: Any = None, replay: Any = None) -> list[list[float]]:
    """The trainer's log-probs (temperature 1) of ``sequences[i][t]`` for t >= 1, through the trainer's own
    forward (``policy_forward``: same attention, packing and log-prob kernels as training)."""
    batch = SequenceBatch.from_rollout([s[:1] for s in sequences], [s[1:] for s in sequences],
                                       [[0.0] * (len(s) - 1) for s in sequences], list(range(len(sequences))),
                                       device=next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logp, _ = policy_forward(model, batch, list(range(len(sequences))), packed=packed, pad_id=pad_id,
                                     temperature=1.0, chunk_size=chunk_size, compute_entropy=False,
                                     logprobs=logprobs, linear_logprobs=linear_logprobs,
                                     replay=replay)  # routing replay on: the probe routes by the model's own
    finally:
        model.train(was_training)
    rows = logp.float().cpu().tolist()
    return [row[: len(s) - 1] for row, s in zip(rows, sequences)]


def probe_diffs(engine: Any, model: Any, sequences: list[list[int]], **forward: Any) -> tuple[float, float]:
    """Largest |engine - trainer| log-prob over the probe tokens (prefill) and over tokens the engine samples at
    decode time (``decode_probe_diff``, where the engine has it); each maximised over ranks."""
    probe = _probe(engine, model, sequences, **forward)
    return probe.prefill, probe.decode


class _Probe(NamedTuple):
    """:func:`probe_diffs`' two differences, and per path the tokens they were measured on with the trainer's
    log-probs of them (what a rounding floor of that path starts from): the probe sequences for prefill, what the
    engine's decode probe sampled for decode."""

    prefill: float
    decode: float
    prefill_tokens: list[list[int]]
    prefill_logprobs: list[list[float]]
    decode_tokens: list[list[int]]
    decode_logprobs: list[list[float]]


def _probe(engine: Any, model: Any, sequences: list[list[int]], **forward: Any) -> _Probe:
    mine = trainer_logprobs(model, sequences, **forward)
    theirs = engine.score(sequences)
    prefill = max(abs(a - b) for m, t in zip(mine, theirs) for a, b in zip(m, t))
    decode = 0.0
    decoded: list[list[int]] = []
    decoded_logprobs: list[list[float]] = []
    probe = getattr(engine, "decode_probe_diff", None)
    if callable(probe):  # prefill (``score``) does not run the decode kernels

        def score(seqs: list[list[int]]) -> list[list[float]]:
            logprobs = trainer_logprobs(model, seqs, **forward)
            decoded.extend(list(s) for s in seqs)
            decoded_logprobs.extend(logprobs)
            return logprobs

        decode = probe(score)
    both = D.all_reduce_(torch.tensor([prefill, decode], dtype=torch.float64), "max")
    return _Probe(float(both[0].item()), float(both[1].item()), sequences, mine, decoded, decoded_logprobs)


def probe_diff(engine: Any, model: Any, sequences: list[list[int]], **forward: Any) -> float:
    """The larger of :func:`probe_diffs`' prefill and decode differences."""
    return max(probe_diffs(engine, model, sequences, **forward))


def sync_and_verify(engine: Any, model: Any, sequences: list[list[int]], dtype: str, **forward: Any) -> dict[str, float]:
    """Sync ``model`` into ``engine`` (woken first), then ``verify``. Returns the sync's metrics."""
    t0 = time.perf_counter()
    wake_up(engine)
    try:
        engine.sync_weights(model)
    except torch.OutOfMemoryError:
        raise  # the run's out-of-memory line, not a loader's refusal
    except (RuntimeError, AttributeError, KeyError, TypeError, ValueError, AssertionError) as exc:
        from polyrl.core.plugins.backend import one_line

        # the engine's loader refused the live model: the same on every rank (same code, same names)
        raise SyncFailed(f"rollout engine {getattr(engine, 'name', '?')!r} could not load the trainer's weights "
                         f"({one_line(exc)}); stopping: an engine that kept its old weights would roll out another "
                         "policy") from exc
    metrics = verify(engine, model, sequences, dtype, **forward)
    metrics["time/sync_s"] = time.perf_counter() - t0
    return metrics


def sleep(engine: Any) -> None:
    """``engine.sleep()`` where the engine has it (an engine from a plugin need not)."""
    if callable(getattr(engine, "sleep", None)):
        engine.sleep()


def wake_up(engine: Any) -> None:
    if callable(getattr(engine, "wake_up", None)):
        engine.wake_up()


# Modules whose outputs the floor perturbs: every matmul and the blocks around them (attention, MLP / experts,
# router, decoder layer), by class name so that any transformers model (and polyrl's own experts) is covered.
_FLOOR_MODULES = ("DecoderLayer", "Attention", "MLP", "MoE", "Moe", "Experts", "Router", "Gate")


@contextlib.contextmanager
def _rounding_noise(model: Any, eps: float, seed: int) -> Iterator[None]:
    """While inside: every linear layer's and compute block's floating-point output ``t`` becomes ``t + t * u``,
    u uniform in [-eps, eps] (seeded, one generator per device)."""
    gens: dict[torch.device, torch.Generator] = {}

    def noisy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        if t.device not in gens:
            gens[t.device] = torch.Generator(device=t.device).manual_seed(seed)
        u = torch.rand(t.shape, generator=gens[t.device], device=t.device, dtype=torch.float32)
        return t + t * u.mul_(2 * eps).sub_(eps).to(t.dtype)

    def hook(module: Any, args: Any, out: Any) -> Any:
        return tuple(noisy(o) for o in out) if isinstance(out, tuple) else noisy(out)

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, torch.nn.Linear) or type(m).__name__.endswith(_FLOOR_MODULES)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# Draws of the rounding noise per floor measurement; a probe that fails against that floor gets this many more
# before the run is stopped. The floor is a maximum over draws, and a near-tie router flips under one draw and not
# the next: on the H200 the tiny DeepSeek's bf16 engine (fp32 router) sat at a median 0.005 nats over ~200 syncs with
# one lone prefill token at 0.109, where two draws had put the floor at 0.0074.
FLOOR_DRAWS = 2
FLOOR_DRAWS_BEFORE_STOP = 8
FLOOR_SEED = 4321


def precision_floor(model: Any, sequences: list[list[int]], dtype: str, *, draws: int = FLOOR_DRAWS,
                    seed: int = FLOOR_SEED, clean: list[list[float]] | None = None,
                    **forward: Any) -> float:
    """How far rounding at ``dtype`` alone moves the trainer's probe log-probs: the largest |difference| between
    the trainer's log-probs and the same forward with ``u * eps`` relative noise (u uniform in [-1, 1], eps the
    unit roundoff of ``dtype``) added to the output of every linear layer and compute block, over ``draws`` seeded
    draws, maximised over ranks. An engine in ``dtype`` rounds at other places than the trainer; a model whose
    routers sit near ties (random-init MoE at full width) moves by this much from rounding alone, which no fixed
    bar can tell from a fault. Costs ``draws`` forwards of the probe, one more where ``clean`` is not given."""
    eps = float(torch.finfo(getattr(torch, dtype)).eps) / 2
    if clean is None:  # the trainer's own log-probs of ``sequences``, where the caller has them already
        clean = trainer_logprobs(model, sequences, **forward)
    worst = 0.0
    for draw in range(draws):
        with _rounding_noise(model, eps, seed + draw):
            perturbed = trainer_logprobs(model, sequences, **forward)
        worst = max([worst, *(abs(a - b) for c, p in zip(clean, perturbed) for a, b in zip(c, p))])
    return float(D.all_reduce_(torch.tensor([worst], dtype=torch.float64), "max")[0].item())


def verify(engine: Any, model: Any, sequences: list[list[int]], dtype: str, **forward: Any) -> dict[str, float]:
    """For an engine with its own weights: check it on the probe in prefill and decode, else raise ``SyncFailed``.
    An engine that is the trainer's model (hf) has nothing to check: {}.

    The bar is ``rollout.sync_probe`` for ``dtype``; below fp32, a path (prefill, decode) whose probe is beyond it
    is then held against the model's own rounding floor on that path's tokens (:func:`precision_floor`: the probe
    sequences for prefill, the sequence the engine sampled for decode — a trained policy's own samples and random
    tokens sit at different depths of its distribution, and the floor differs between them by 10x): that path's
    bar becomes ``rollout.sync_probe_floor_factor`` times its floor where that is larger (metrics
    ``rollout/sync_probe_floor`` and ``rollout/sync_probe_bar`` for prefill, ``..._decode`` for decode)."""
    if not is_verified(engine):
        return {}
    fixed = tolerance("rollout.sync_probe", dtype)
    probe = _probe(engine, model, sequences, **forward)
    prefill, decode = probe.prefill, probe.decode
    metrics = {"rollout/sync_probe_diff": max(prefill, decode), "rollout/sync_probe_prefill": prefill,
               "rollout/sync_probe_decode": decode}
    bars = {"prefill": fixed, "decode": fixed}
    factor = tolerance("rollout.sync_probe_floor_factor", dtype) if dtype in ("bfloat16", "float16") else None
    notes = []
    for path, diff, seqs, clean, suffix in (
            ("prefill", prefill, probe.prefill_tokens, probe.prefill_logprobs, ""),
            ("decode", decode, probe.decode_tokens, probe.decode_logprobs, "_decode")):
        if factor is None or diff <= fixed or not seqs:
            continue
        floor, draws = precision_floor(model, seqs, dtype, draws=FLOOR_DRAWS, clean=clean, **forward), FLOOR_DRAWS
        if diff > max(fixed, factor * floor):  # before stopping the run: a closer look at the floor
            more = precision_floor(model, seqs, dtype, draws=FLOOR_DRAWS_BEFORE_STOP, seed=FLOOR_SEED + FLOOR_DRAWS,
                                   clean=clean, **forward)
            floor, draws = max(floor, more), FLOOR_DRAWS + FLOOR_DRAWS_BEFORE_STOP
        bars[path] = max(fixed, factor * floor)
        metrics[f"rollout/sync_probe_floor{suffix}"], metrics[f"rollout/sync_probe_bar{suffix}"] = floor, bars[path]
        notes.append(f"{path} {bars[path]:.3g} = {factor:g}x the model's own {dtype} floor {floor:.3g} on its tokens "
                     f"({draws} draws)")
    failed = [(path, diff) for path, diff in (("prefill", prefill), ("decode", decode)) if diff > bars[path]]
    if failed:
        where = " and ".join(path for path, _ in failed)
        bar_note = f"tolerance {fixed:g} for {dtype}" + (f"; {', '.join(notes)}" if notes else "")
        raise SyncFailed(
            f"rollout engine {engine.name!r} does not reproduce the trainer after the weight sync: its log-probs "
            f"differ by up to {max(d for _, d in failed):.3g} in {where} (prefill {prefill:.3g}, decode {decode:.3g}; "
            f"{bar_note}). Training on its samples would train on another policy; stopping. "
            "Likely causes: a weight the engine does not load (check the model's HF names), decode weights its "
            "post-load processing did not rebuild, an engine that computes a step in another precision than the "
            "trainer (a router in bf16), or an attention convention of the inference kernel that differs "
            "from training's (sliding window, sinks)")
    return metrics
