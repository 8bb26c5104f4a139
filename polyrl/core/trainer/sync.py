"""Weight sync into the rollout engine, verified: never generate from a stale policy.

After every update the trainer hands its weights to the engine (``engine.sync_weights``). An engine that holds
its own copy (``is_verified``: vLLM) is then checked: it scores a fixed probe batch and its per-token
log-probs are compared with the trainer's own on the same tokens. Beyond the tolerance
(``rollout.sync_probe`` in polyrl.core.tolerances) the engine is rebuilt from a full export of the weights and
checked again; if that fails too, the run stops (``SyncFailed``) — a stale or half-loaded engine (experts or
sinks not updated, a partial load, an inference kernel with another sliding-window convention) would
otherwise train on samples from a policy that is not the one being optimised.

The probe: sequences of pseudo-random tokens (a fixed seed: the same probe every step), one short, and for a
model with sliding-window layers one longer than the window by half a window, so the check covers the
sliding layers beyond the window edge as well as the full ones. The decision uses the largest difference over
all ranks (each rank checks its own engine; the rebuild is collective under FSDP).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from polyrl.core import distributed as D
from polyrl.core.rollout import is_verified
from polyrl.core.tolerances import tolerance
from polyrl.core.trainer.batch import SequenceBatch, policy_forward
from polyrl.core.trainer.experience import TrainingAborted


class SyncFailed(TrainingAborted):
    """The engine's log-probs still differ from the trainer's after a rebuild: the message says by how much."""


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
                     logprobs: Any, linear_logprobs: Any = None) -> list[list[float]]:
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
                                     logprobs=logprobs, linear_logprobs=linear_logprobs)
    finally:
        model.train(was_training)
    rows = logp.float().cpu().tolist()
    return [row[: len(s) - 1] for row, s in zip(rows, sequences)]


def probe_diff(engine: Any, model: Any, sequences: list[list[int]], **forward: Any) -> float:
    """Largest |engine - trainer| log-prob over the probe tokens (prefill) and, for an engine that has it, over
    tokens it samples at decode time past the sliding window (``decode_probe_diff``); maximised over ranks."""
    mine = trainer_logprobs(model, sequences, **forward)
    theirs = engine.score(sequences)
    worst = max(abs(a - b) for m, t in zip(mine, theirs) for a, b in zip(m, t))
    decode = getattr(engine, "decode_probe_diff", None)
    if callable(decode):  # prefill (``score``) does not run the decode kernels: check them past the window too
        worst = max(worst, decode(lambda seqs: trainer_logprobs(model, seqs, **forward)))
    return float(D.all_reduce_(torch.tensor(worst, dtype=torch.float64), "max").item())


def sync_and_verify(engine: Any, model: Any, sequences: list[list[int]], dtype: str, **forward: Any) -> dict[str, float]:
    """Sync ``model`` into ``engine`` (woken first), then ``verify``. Returns the sync's metrics."""
    t0 = time.perf_counter()
    wake_up(engine)
    engine.sync_weights(model)
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


def verify(engine: Any, model: Any, sequences: list[list[int]], dtype: str, **forward: Any) -> dict[str, float]:
    """For an engine with its own weights: check it on the probe, repair by one rebuild, else raise
    ``SyncFailed``. An engine that is the trainer's model (hf) has nothing to check: {}."""
    if not is_verified(engine):
        return {}
    bar = tolerance("rollout.sync_probe", dtype)
    diff = probe_diff(engine, model, sequences, **forward)
    metrics = {"rollout/sync_probe_diff": diff, "rollout/sync_rebuilt": 0.0}
    if diff > bar:
        engine.rebuild(model)
        diff = probe_diff(engine, model, sequences, **forward)
        metrics.update({"rollout/sync_probe_diff": diff, "rollout/sync_rebuilt": 1.0})
        if diff > bar:
            raise SyncFailed(
                f"rollout engine {engine.name!r} does not reproduce the trainer after a rebuild: its log-probs on "
                f"the probe batch differ by up to {diff:.3g} (tolerance {bar:g} for {dtype}). Training on its "
                "samples would train on another policy; stopping. Likely causes: a weight the engine does not "
                "load (check the model's HF names), or an attention convention of the inference kernel that "
                "differs from training's (sliding window, sinks)")
    return metrics
