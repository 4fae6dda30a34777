"""The `algorithm` section of a run's configuration (megarl.config): the advantage estimator
and the policy loss (by the names registered in megarl.algo.registry, or import strings),
their settings, KL, dynamic sampling and overlong shaping; and `check_algorithm`, the rules
that tie the estimator and the loss to the rest of the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.config_loader import Problems, param


@dataclass
class DynamicSamplingConfig:
    enable: bool = param(True, "Drop prompt groups whose metric is constant and refill (DAPO dynamic sampling).")
    metric: Literal["acc", "score"] = param("acc", "Per-sample value whose variance decides a group is informative: "
                                            "acc (the reward's correctness) or score (the reward).")
    max_num_gen_batches: int = param(10, "Generation batches per step before giving up; 0 = unlimited.", ge=0)


@dataclass
class OverlongConfig:
    enable: bool = param(True, "Soft overlong punishment (DAPO): penalise responses inside the last buffer_len tokens.")
    buffer_len: int = param(4096, "Length of the punishment zone in tokens, ending at rollout.max_response_length.", gt=0)
    penalty_factor: float = param(1.0, "Penalty at the maximum length.", ge=0.0)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = param(
        "grpo", "Advantage estimator: a registered name (grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline; "
        "gae, which needs critic.enable=true) or 'module.path:function', a function of your own decorated with "
        "megarl.algo.register_advantage_estimator (megarl.algo.registry).")
    policy_loss: str = param(
        "ppo", "Policy loss: a registered name (ppo: the clipped loss with clip-higher, dual clip, GSPO by "
        "ratio_level and TIS by tis_cap; cispo: MiniMax-M1's clipped importance weights) or 'module.path:function', "
        "a function of your own, plain or decorated with megarl.algo.register_policy_loss (megarl.algo.registry).")
    norm_adv_by_std: bool = param(True, "GRPO divides by the group std; false is Dr.GRPO.")
    gamma: float = param(1.0, "Discount factor (REINFORCE++, GAE).", ge=0.0, le=1.0)
    lam: float = param(1.0, "GAE lambda.", ge=0.0, le=1.0)
    clip_ratio_low: float = param(
        0.2, "PPO clip below: ratio >= 1 - clip_ratio_low (cispo: the importance weight's lower bound).", ge=0.0, lt=1.0)
    clip_ratio_high: float = param(
        0.28, "PPO clip above (DAPO clip-higher): ratio <= 1 + clip_ratio_high (cispo: the weight's upper bound).",
        ge=0.0)
    clip_ratio_c: float = param(3.0, "Dual-clip bound on negative-advantage losses (> 1).", gt=1.0)
    ratio_level: Literal["token", "sequence"] = param("token", "Importance ratio per token (PPO) or per sequence (GSPO).")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = param(
        "token-mean", "Loss aggregation; token-mean is DAPO's token-level loss over the global batch."
    )
    entropy_coeff: float = param(0.0, "Entropy bonus coefficient.", ge=0.0)
    use_kl_loss: bool = param(False, "Add a KL(policy || reference) loss term (DAPO: off).")
    kl_loss_coef: float = param(0.001, "Weight of the KL loss term.", ge=0.0)
    kl_loss_type: Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"] = param("low_var_kl", "KL estimator of the loss term.")
    use_kl_in_reward: bool = param(False, "Subtract a per-token KL penalty from the reward instead.")
    kl_reward_coef: float = param(0.001, "Weight of the KL reward penalty.", ge=0.0)
    kl_reward_type: Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"] = param("k1", "KL estimator of the reward penalty.")
    tis_cap: float | None = param(
        None, "Truncated importance sampling against the rollout log-probs, weights capped here; None = off.", gt=0.0
    )
    tis_level: Literal["token", "sequence"] = param(
        "token", "TIS weight per token, or one per sequence (the product of its token ratios, capped).")
    old_log_probs: Literal["trainer", "engine"] = param(
        "trainer", "Where the old policy's log-probs (the PPO ratio's denominator) come from: trainer = a forward "
        "pass of the step's batch by the train model; engine = the log-probs the engine returned with each sampled "
        "token (one forward pass less a step; exact only where engine and trainer compute the same numbers, as the "
        "embedded engine in float32 on the CPU; on GPUs their kernels differ, and the ratio then starts off 1).")
    dynamic_sampling: DynamicSamplingConfig = param(help="DAPO dynamic sampling.", factory=DynamicSamplingConfig)
    overlong: OverlongConfig = param(help="DAPO soft overlong punishment.", factory=OverlongConfig)


def check_algorithm(cfg, problems: Problems) -> None:
    """algorithm.adv_estimator and algorithm.policy_loss name functions megarl can call, and the
    run (`cfg`: a RunConfig) gives the estimator what its registration says it needs: a critic
    (critic.enable), groups of rollout.n >= 2 samples. Imports megarl.algo (torch) and the
    user's modules the two name, so a plan (which skips these rules) stays free of torch."""
    from megarl.algo.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, advantage_estimator, policy_loss_function

    a, critic, n = cfg.algorithm, cfg.critic.enable, cfg.rollout.n

    try:
        estimator = advantage_estimator(a.adv_estimator)
    except ValueError as error:
        problems.add("algorithm.adv_estimator", str(error), f"use one of {sorted(ADVANTAGE_ESTIMATORS)} or an "
                     "importable 'module.path:function' decorated with megarl.algo.register_advantage_estimator")
    else:
        if estimator.needs_critic and not critic:
            problems.add("algorithm.adv_estimator", f"{a.adv_estimator} needs a critic",
                         "set critic.enable=true or use an estimator without one: "
                         f"{sorted(k for k, e in ADVANTAGE_ESTIMATORS.items() if not e.needs_critic)}")
        if estimator.needs_groups and n < 2:
            problems.add("rollout.n", f"{n} gives groups of one sample, so {a.adv_estimator} has no baseline",
                         "use rollout.n >= 2 (DAPO: 16), or an estimator without groups: "
                         f"{sorted(k for k, e in ADVANTAGE_ESTIMATORS.items() if not e.needs_groups)}")
    try:
        policy_loss_function(a.policy_loss)
    except ValueError as error:
        problems.add("algorithm.policy_loss", str(error),
                     f"use one of {sorted(POLICY_LOSSES)} or an importable 'module.path:function'")
