"""RL algorithm math for megarl: advantages, losses, KL, loss aggregation, dynamic
sampling and overlong shaping. Pure torch functions over (B,) / (B, T) tensors with no
distributed assumptions and no imports from the rest of megarl but megarl.import_string.

The advantage estimators and policy losses a run selects by name (algorithm.adv_estimator,
algorithm.policy_loss) are registered in megarl.algo.registry; importing this package
registers the built-ins. Users register their own with the decorators exported here.
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
from megarl.algo.policy_loss import (RATIO_LEVELS, cispo_policy_loss, entropy_from_logits, policy_loss,
                                     ppo_policy_loss, value_loss)
from megarl.algo.registry import (AdvantageEstimator, advantage_estimator, policy_loss_function,
                                  register_advantage_estimator, register_policy_loss)

__all__ = [
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "RATIO_LEVELS",
    "AdvantageEstimator",
    "DynamicSamplingError",
    "InformativeGroupBuffer",
    "advantage_estimator",
    "agg_loss",
    "cispo_policy_loss",
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
    "policy_loss_function",
    "ppo_policy_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "scores_to_token_rewards",
    "value_loss",
]
