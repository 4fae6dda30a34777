"""RL algorithm math for megarl: advantages, losses, KL, loss aggregation, dynamic
sampling and overlong shaping. Pure torch functions over (B,) / (B, T) tensors with no
distributed assumptions and no imports from the rest of megarl.
"""

from megarl.algo.advantages import (
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_rloo_advantages,
    scores_to_token_rewards,
)
from megarl.algo.aggregation import LOSS_AGG_MODES, agg_loss
from megarl.algo.dynamic_sampling import DynamicSamplingError, InformativeGroupBuffer, informative_group_mask
from megarl.algo.kl import KL_KINDS, kl_penalty
from megarl.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megarl.algo.overlong import overlong_penalty
from megarl.algo.policy_loss import RATIO_LEVELS, entropy_from_logits, policy_loss, value_loss

__all__ = [
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "RATIO_LEVELS",
    "DynamicSamplingError",
    "InformativeGroupBuffer",
    "agg_loss",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_rloo_advantages",
    "entropy_from_logits",
    "informative_group_mask",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "scores_to_token_rewards",
    "value_loss",
]
