"""Rule rewards for megarl: scoring routed by data_source (Search-R1 exact match, DAPO
math), math-verify accuracy and the open-r1 shaping rewards, combined by weights, and a
process pool that scores a batch under a time limit per call.

Entry points:
- `compute_score(data_source, solution_str, ground_truth, extra_info=None)`: one response;
- `RewardConfig` (the run config's `reward` section) + `score_one(cfg, request)`: the
  reward a run is configured with;
- `RewardPool(cfg, num_workers, timeout_s).compute(requests)`: a batch, as the trainer
  calls it.

The overlong penalty is not a reward component: it is algorithm.overlong, added once after
the reward (megarl.experience.shape_overlong).

Nothing here imports the rest of megarl except megarl.config_loader (the `param` fields of
RewardConfig) and megarl.algo's overlong_penalty (only when soft_overlong_reward is called).
"""

from megarl.reward.dapo_math import dapo_math_score, normalize_answer_lenient, normalize_answer_verl
from megarl.reward.math_verify_reward import math_verify_accuracy
from megarl.reward.open_r1 import (
    cosine_scaled_reward,
    format_reward,
    len_rewards,
    reasoning_steps_reward,
    repetition_penalty_reward,
    soft_overlong_reward,
    tag_count_reward,
)
from megarl.reward.pool import RewardPool, RewardStats, score_guarded
from megarl.reward.registry import ROUTES, SCORERS, Route, Scorer, compute_score, load_custom_function
from megarl.reward.scoring import RewardRequest, RewardResult, apply_group_rewards, combine_rewards, score_one
from megarl.reward.settings import COMPONENT_NAMES, RewardConfig, check_reward_config
from megarl.reward.search_r1 import normalize_answer, search_r1_em_score, search_r1_format_score
from megarl.reward.timeout import RewardTimeout, call_with_timeout

__all__ = [
    "COMPONENT_NAMES",
    "ROUTES",
    "SCORERS",
    "RewardConfig",
    "RewardPool",
    "RewardRequest",
    "RewardResult",
    "RewardStats",
    "RewardTimeout",
    "Route",
    "Scorer",
    "apply_group_rewards",
    "call_with_timeout",
    "check_reward_config",
    "combine_rewards",
    "compute_score",
    "cosine_scaled_reward",
    "dapo_math_score",
    "format_reward",
    "len_rewards",
    "load_custom_function",
    "math_verify_accuracy",
    "normalize_answer",
    "normalize_answer_lenient",
    "normalize_answer_verl",
    "reasoning_steps_reward",
    "repetition_penalty_reward",
    "score_guarded",
    "score_one",
    "search_r1_em_score",
    "search_r1_format_score",
    "soft_overlong_reward",
    "tag_count_reward",
]
