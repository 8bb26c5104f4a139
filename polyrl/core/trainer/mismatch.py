"""The rollout correction of one batch: its weights and kept tokens for the update, and the mismatch metrics.

:func:`rollout_correction` is ``prepare_update``'s share of the work (pure, and collective under ``--nproc``:
its metrics are the global batch's). The math is ``polyrl.core.algorithms.rollout_correction``; this module
decides what the update gets and reduces the figures over ranks: every mean in one all-reduce of fp64 sums and
counts taken on the host, every max in one more (the same numbers as a one-process run of the same rows).
"""

from __future__ import annotations

import torch

from polyrl.core import distributed as D
from polyrl.core.algorithms import rollout_correction as RC
from polyrl.core.config import AlgorithmConfig, RolloutCorrectionConfig
from polyrl.core.errors import BadInputError
from polyrl.core.trainer.metrics import MismatchMetrics


def resolve_enable(rc: RolloutCorrectionConfig, engine_name: str, own_weights: bool) -> tuple[bool, str]:
    """``rc.enable`` resolved for this run's engine, and one line for the run log saying what was chosen."""
    on = own_weights if rc.enable == "auto" else bool(rc.enable)
    why = (f"auto: engine {engine_name} {'has its own weights' if own_weights else 'shares the trainer weights'}"
           if rc.enable == "auto" else f"algorithm.rollout_correction.enable={str(rc.enable).lower()}")
    if not on:
        return False, f"rollout correction off ({why}); mismatch metrics only"
    parts = []
    if rc.is_level is not None:
        parts.append(f"{rc.is_level}-level IS weights capped at {rc.is_cap:g}")
    if rc.token_mask_band is not None:
        parts.append(f"tokens outside ratio band {rc.token_mask_band} masked")
    if rc.seq_reject is not None:
        parts.append(f"sequences rejected by {rc.seq_reject} ratio outside {rc.seq_reject_band}")
    return True, f"rollout correction on ({why}): {'; '.join(parts)}"


def resolve_old_logprobs(alg: AlgorithmConfig, engine_name: str, own_weights: bool, correction_on: bool,
                         routing_replay: str) -> tuple[bool, str]:
    """Whether π_old is the engine's sampling log-probs (``algorithm.old_logprobs`` resolved for this engine, with the
    rollout correction already resolved), and one line for the run log. auto takes the engine's for an engine that
    shares the trainer's weights (hf: it samples with the trainer's own model, so its log-probs are the behaviour
    policy's, to rounding), unless the correction is on (its weights compare the two) or r2 replays the routing of
    the trainer's forward. An explicit ``engine`` that cannot be honoured is a config error."""
    mode = alg.old_logprobs
    if mode == "engine" and correction_on:
        raise BadInputError(f"algorithm.old_logprobs=engine: the rollout correction is on for engine {engine_name} "
                            "(algorithm.rollout_correction.enable resolved to true) and needs the trainer's "
                            "recomputed log-probs; set rollout_correction.enable=false or old_logprobs=recompute")
    if mode == "engine" and routing_replay == "r2":
        raise BadInputError("algorithm.old_logprobs=engine: rollout.routing_replay=r2 needs the trainer's "
                            "old-log-prob forward")
    if mode == "auto":
        use = not own_weights and not correction_on and routing_replay != "r2"
        why = (f"auto: engine {engine_name} "
               + ("shares the trainer's weights" if use else
                  "has its own weights" if own_weights else
                  "with the rollout correction on" if correction_on else "with routing replay r2"))
    else:
        use, why = mode == "engine", f"algorithm.old_logprobs={mode}"
    if not use:
        return False, f"old log-probs recomputed by the trainer ({why})"
    every = alg.old_logprobs_check_every
    check = (f"the trainer's forward every {every} steps as a drift check (rollout/logprob_diff, actor/entropy)"
             if every else "no drift check")
    return True, f"old log-probs from the engine ({why}); {check}"


def rollout_correction(
    rc: RolloutCorrectionConfig, old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor | None, MismatchMetrics]:
    """(weights, keep, metrics) for one rank's ``[B, R]`` rows. ``rc.enable`` must be resolved (a bool).

    weights: the truncated IS weight per token (None when the correction is off or ``is_level`` is null); keep:
    the 0/1 tokens the update keeps (None when off or nothing masks). The metrics are computed either way, for
    the configured level (token level when ``is_level`` is null), band and rejection."""
    if not isinstance(rc.enable, bool):
        raise ValueError("rollout_correction: resolve algorithm.rollout_correction.enable first (resolve_enable)")
    delta = RC.log_ratio(old_logp, rollout_logp, mask)
    rho, w = RC.is_weights(delta, mask, rc.is_level or "token", rc.is_cap)
    masks = rc.token_mask_band is not None or rc.seq_reject is not None
    band = tuple(rc.token_mask_band) if rc.token_mask_band is not None else None
    rband = tuple(rc.seq_reject_band) if rc.seq_reject_band is not None else None
    keep = RC.keep_mask(delta, mask, token_band=band, reject=rc.seq_reject, reject_band=rband)
    metrics = _metrics(delta, rho, w, keep, mask, rc.is_cap, applied=rc.enable)
    if not rc.enable:
        return None, None, metrics
    weights = w.detach() if rc.is_level is not None else None
    return weights, (keep.detach() if masks else None), metrics


def _metrics(delta: torch.Tensor, rho: torch.Tensor, w: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor,
             cap: float, *, applied: bool) -> MismatchMetrics:
    f64 = torch.float64
    m = mask.detach().cpu().to(f64).bool()
    delta, rho, w, keep = (t.detach().cpu().to(f64) for t in (delta, rho, w, keep))
    k1, k3 = RC.k1_k3(delta, m)
    seq = m.any(-1)  # [B] rows with a response token
    n_tok = m.sum(-1).clamp(min=1).to(f64)
    clipped = (rho > cap) & m
    dropped = m & (keep == 0)
    seq_w, seq_rho = (w * m).sum(-1) / n_tok, (rho * m).sum(-1) / n_tok
    tok = m.to(f64)
    per_token = [k1, k3, w, clipped.to(f64), dropped.to(f64)]
    per_seq = [k1.sum(-1), seq_w, clipped.any(-1).to(f64), dropped.any(-1).to(f64)]
    sums = torch.stack([*(x.sum() for x in per_token), tok.sum(),
                        *((x * seq).sum() for x in per_seq), seq.to(f64).sum()])
    sums = D.all_reduce_(sums).tolist()
    t_count, s_count = max(sums[5], 1.0), max(sums[10], 1.0)
    k1_m, k3_m, w_m, clip_f, drop_f = (v / t_count for v in sums[:5])
    sk1, sw, sclip, sdrop = (v / s_count for v in sums[6:10])
    neg = torch.tensor(float("-inf"), dtype=f64)
    maxes = torch.stack([torch.where(m, rho, neg).max() if m.any() else neg,
                         torch.where(seq, seq_rho, neg).max() if seq.any() else neg])
    maxes = D.all_reduce_(maxes, op="max").tolist()
    rho_max, seq_rho_max = (v if v != float("-inf") else 0.0 for v in maxes)
    return MismatchMetrics(
        mismatch_applied=int(applied), mismatch_k1=k1_m, mismatch_k3=k3_m, mismatch_seq_k1=sk1,
        mismatch_is_mean=w_m, mismatch_is_max=rho_max, mismatch_is_clipped_frac=clip_f, mismatch_masked_frac=drop_f,
        mismatch_seq_is_mean=sw, mismatch_seq_is_max=seq_rho_max, mismatch_seq_clipped_frac=sclip,
        mismatch_seq_masked_frac=sdrop,
    )
