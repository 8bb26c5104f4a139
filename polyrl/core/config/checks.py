"""Cross-field checks of a recipe: the rules the per-field types cannot express.

:func:`check_config` runs once, when a config is loaded (``load_config`` / ``config_from_dict``), so the dry
run, the launcher and every worker see the same verdict. What depends on the world size is
``polyrl.core.distributed.sharding.check_placement``.
"""

from __future__ import annotations

import math

from polyrl.core.config.schema import RolloutCorrectionConfig, RunConfig
from polyrl.core.errors import BadInputError


def check_config(cfg: RunConfig) -> None:
    """Cross-field checks the per-field types cannot express."""
    alg, ro = cfg.algorithm, cfg.rollout
    if alg.clip_c is not None and alg.clip_c <= 1.0:
        raise BadInputError(f"algorithm.clip_c: expected a number > 1 (or null), got {alg.clip_c}")
    if alg.overlong.enable and not 0 < alg.overlong.buffer_length <= ro.max_response_length:
        raise BadInputError(
            f"algorithm.overlong.buffer_length: expected 1..rollout.max_response_length "
            f"({ro.max_response_length}), got {alg.overlong.buffer_length}"
        )
    if ro.routing_replay is True:
        raise BadInputError("rollout.routing_replay: expected one of 'off', 'r2', 'r3', got true")
    if ro.sleep_level is not None and (isinstance(ro.sleep_level, bool) or ro.sleep_level not in (0, 1)):
        raise BadInputError(f"rollout.sleep_level: expected null, 0 (awake) or 1 (asleep while training), got "
                            f"{ro.sleep_level!r} (vLLM's level 2 discards buffers a sync does not write)")
    if ro.decode in ("static", "graph") and ro.routing_replay == "r3":
        raise BadInputError(f"rollout.decode={ro.decode}: routing replay r3 records the routers' choices in every "
                            "decode step, which a static step (captured once) cannot; use rollout.decode=dynamic")
    if ro.temperature <= 0 or not 0 < ro.top_p <= 1:
        raise BadInputError("rollout: temperature must be > 0 and top_p in (0, 1]")
    for name, value in (("data.batch_size", cfg.data.batch_size), ("rollout.n", ro.n),
                        ("algorithm.ppo_epochs", alg.ppo_epochs), ("algorithm.mini_batch_size", alg.mini_batch_size),
                        ("rollout.max_response_length", ro.max_response_length),
                        ("trainer.total_steps", cfg.trainer.total_steps),
                        ("sharding.expert_parallel", cfg.sharding.expert_parallel)):
        if value < 1:
            raise BadInputError(f"{name}: expected an integer >= 1, got {value}")
    if alg.adv_estimator == "grpo" and ro.n < 2:
        raise BadInputError("rollout.n: grpo needs at least 2 samples per prompt")
    _check_lora(cfg)
    _check_rollout_correction(alg.rollout_correction)
    _check_old_logprobs(cfg)


def _check_band(name: str, band: list[float]) -> None:
    """A ratio band [low, high] around 1: identical policies (every ratio 1) must pass it."""
    if len(band) != 2 or not (0 < band[0] <= 1 <= band[1] and band[0] < band[1] and math.isfinite(band[1])):
        raise BadInputError(f"{name}: expected [low, high] with 0 < low <= 1 <= high, low < high, got {band}")


def _check_rollout_correction(rc: RolloutCorrectionConfig) -> None:
    where = "algorithm.rollout_correction"
    if not (rc.is_cap > 0 and math.isfinite(rc.is_cap)):
        raise BadInputError(f"{where}.is_cap: expected a finite number > 0, got {rc.is_cap}")
    if rc.token_mask_band is not None:
        _check_band(f"{where}.token_mask_band", rc.token_mask_band)
    if (rc.seq_reject is None) != (rc.seq_reject_band is None):
        raise BadInputError(f"{where}: seq_reject and seq_reject_band go together (got seq_reject={rc.seq_reject}, "
                            f"seq_reject_band={rc.seq_reject_band})")
    if rc.seq_reject_band is not None:
        _check_band(f"{where}.seq_reject_band", rc.seq_reject_band)
    if rc.enable is True and rc.is_level is None and rc.token_mask_band is None and rc.seq_reject is None:
        raise BadInputError(f"{where}.enable: true with is_level, token_mask_band and seq_reject all null "
                            "corrects nothing")


def _check_old_logprobs(cfg: RunConfig) -> None:
    """algorithm.old_logprobs against what needs the trainer's own π_old (what depends on the engine is resolved
    when the trainer is built: polyrl.core.trainer.mismatch.resolve_old_logprobs)."""
    alg = cfg.algorithm
    every = alg.old_logprobs_check_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise BadInputError(f"algorithm.old_logprobs_check_every: expected an integer >= 0, got {every!r}")
    if alg.old_logprobs != "engine":
        return
    if alg.rollout_correction.enable is True:
        raise BadInputError("algorithm.old_logprobs=engine: the rollout correction weighs the engine's log-probs "
                            "against the trainer's recomputed ones; with engine log-probs as pi_old every weight "
                            "is 1 (set algorithm.rollout_correction.enable=false, or old_logprobs=recompute)")
    if cfg.rollout.routing_replay == "r2":
        raise BadInputError("algorithm.old_logprobs=engine: rollout.routing_replay=r2 replays the routing of the "
                            "trainer's old-log-prob forward, which engine log-probs skip (use r3, or "
                            "old_logprobs=recompute)")


def _check_lora(cfg: RunConfig) -> None:
    """model.lora's values (what needs the model, targets that match nothing, is polyrl.core.models.lora's)."""
    lora = cfg.model.lora
    if not lora.enabled:
        return
    if lora.rank < 1:
        raise BadInputError(f"model.lora.rank: expected an integer >= 1, got {lora.rank}")
    if not lora.alpha > 0:
        raise BadInputError(f"model.lora.alpha: expected a number > 0, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise BadInputError(f"model.lora.dropout: expected a number in [0, 1), got {lora.dropout}")
    for key in ("target_modules", "target_parameters"):
        for name in getattr(lora, key):
            if not name or name.strip(".") != name or " " in name:
                raise BadInputError(f"model.lora.{key}: {name!r} is not a module or parameter path")
    if lora.preset == "none" and not (lora.target_modules or lora.target_parameters):
        raise BadInputError("model.lora.preset: none needs model.lora.target_modules or target_parameters")
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise BadInputError("model.lora needs peft, which is not installed: pip install 'polyrl[lora]'")
    if cfg.sharding.expert_parallel > 1:
        raise BadInputError(f"model.lora with sharding.expert_parallel={cfg.sharding.expert_parallel}: adapters on "
                            "split experts are not supported; set sharding.expert_parallel=1")

