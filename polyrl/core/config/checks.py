"""Cross-field checks of a recipe: the rules the per-field types cannot express.

:func:`check_config` runs once, when a config is loaded (``load_config`` / ``config_from_dict``), so the dry
run, the launcher and every worker see the same verdict. What depends on the world size is
``polyrl.core.distributed.sharding.check_placement``.
"""

from __future__ import annotations

from polyrl.core.config.schema import RunConfig
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

