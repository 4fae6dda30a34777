"""Per-token estimators of KL(π_θ ‖ π_ref) from the log-probs of the sampled tokens.

Main entry point: `kl_penalty`. The result is (B, T) per token, so it serves both as a
loss term (reduce it with `agg_loss`) and as a reward penalty (subtract coef·kl from the
token-level rewards). With samples y ~ π_θ and d = log π_θ(y) − log π_ref(y):
k1 = d is unbiased but noisy and can be negative; k2 = ½d² is biased, low variance;
k3 = e^{−d} + d − 1 is unbiased for KL and always ≥ 0 (Schulman, "Approximating KL").
"""

from __future__ import annotations

import torch

# alias → canonical kind; the aliases are verl's names for the same estimators
KL_KINDS = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}

# k3 is clamped to ±K3_BOUND: a token whose ratio has blown up must not dominate the loss
K3_BOUND = 10.0
# |d| = 20 already puts k3 above K3_BOUND on both sides, so clamping d there changes no
# value but keeps exp() finite (an inf would turn the clamped gradient into 0·inf = NaN)
K3_LOG_RATIO_BOUND = 20.0


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference, in nats.

    d = logp − ref (log-probs of the sampled tokens, both (B, T)):
    "k1" / "kl"          d
    "abs"                |d|
    "k2" / "mse"         ½·d²
    "k3" / "low_var_kl"  clamp(exp(−d) + d − 1, −10, 10)   (= e^{ref−logp} − (ref−logp) − 1)
    Returns (B, T); padding is not masked here (reduce with a mask downstream).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
    log_ratio = log_prob - ref_log_prob
    canonical = KL_KINDS[kind]
    if canonical == "k1":
        return log_ratio
    if canonical == "abs":
        return log_ratio.abs()
    if canonical == "k2":
        return 0.5 * log_ratio.square()
    ref_minus_logp = (-log_ratio).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return (torch.exp(ref_minus_logp) - ref_minus_logp - 1).clamp(-K3_BOUND, K3_BOUND)
