"""RL algorithms as pure functions: advantages, losses, KL, aggregation, logprobs, DAPO sampling.

``from polyrl.core import algorithms as A`` exposes the public names of docs/algorithms.md.
Formulas follow verl (see the docs for where and why polyrl deliberately differs).
"""

from polyrl.core.algorithms.advantages import (
    broadcast_to_tokens,
    gae_advantages,
    group_advantages,
    group_stats,
    last_token_rewards,
    masked_whiten,
    sequence_scores,
)
from polyrl.core.algorithms.aggregation import (
    AGG_MODES,
    aggregate,
    global_seq_count,
    global_token_count,
    masked_mean,
    masked_sum,
    token_mean_scale,
)
from polyrl.core.algorithms.dapo import (
    filter_groups,
    overlong_penalty,
)
from polyrl.core.algorithms.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    compute_kl_in_reward,
    kl_penalty,
)
from polyrl.core.algorithms.linear_logprobs import linear_logprobs_and_entropy
from polyrl.core.algorithms.logprobs import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from polyrl.core.algorithms.losses import LOG_RATIO_CLAMP, entropy_loss, policy_loss, value_loss

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "LOG_RATIO_CLAMP",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate",
    "broadcast_to_tokens",
    "compute_kl_in_reward",
    "entropy_from_logits",
    "entropy_loss",
    "filter_groups",
    "gae_advantages",
    "global_seq_count",
    "global_token_count",
    "group_advantages",
    "group_stats",
    "kl_penalty",
    "last_token_rewards",
    "linear_logprobs_and_entropy",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "sequence_scores",
    "token_mean_scale",
    "value_loss",
]
