"""Actor and critic losses: clipped PPO policy loss (clip-higher, dual clip, GSPO
sequence ratio, truncated importance sampling), CISPO, clipped value loss, and entropy.

The policy losses algorithm.policy_loss selects are registered here (megarl.algo.registry):
"ppo" (`policy_loss` with the run's settings) and "cispo".

Main entry points: `policy_loss`, `value_loss`. Both return (loss, metrics) where loss is
reduced by `agg_loss` (pass the global num_tokens / num_seqs for gradient accumulation,
see megarl.algo.aggregation) and metrics are Python floats, masked means over the valid
tokens of this call.
"""

from __future__ import annotations

import torch

from megarl.algo.aggregation import Count, agg_loss
from megarl.algo.masked import masked_mean
from megarl.algo.registry import register_policy_loss

RATIO_LEVELS = ("token", "sequence")

# log-ratios are clamped before exp: a stale or garbage log-prob must not overflow to inf
LOG_RATIO_BOUND = 20.0


def _importance_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor, ratio_level: str):
    """Per-token ratio, (B, T).

    token:    ρ_t = exp(logp_t − old_t)
    sequence: ρ_t = sg(s_i)·exp(logp_t − sg(logp_t)),  s_i = exp(mean_{valid t}(logp_t − old_t))
              (GSPO: value s_i on every token, gradient s_i·∇logp_t)
    """
    log_ratio = log_prob - old_log_prob
    if ratio_level == "token":
        return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    seq_log_ratio = masked_mean(log_ratio.detach(), mask, dim=-1)
    seq_ratio = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return seq_ratio[:, None] * torch.exp(log_prob - log_prob.detach())


def _check_tis(rollout_log_prob: torch.Tensor | None, tis_cap: float | None, tis_level: str) -> None:
    if tis_cap is not None and rollout_log_prob is None:
        raise ValueError(
            f"tis_cap={tis_cap} turns on truncated importance sampling but rollout_log_prob is None; "
            "have the rollout engine return log-probs, or set algorithm.tis_cap=null"
        )
    if tis_level not in RATIO_LEVELS:
        raise ValueError(f"unknown tis_level {tis_level!r}; valid: {', '.join(RATIO_LEVELS)}")
    if tis_cap is not None and tis_cap <= 0:
        raise ValueError(f"tis_cap={tis_cap} must be > 0 (it caps the importance weights)")


def _truncated_importance_sampling(token_loss: torch.Tensor, old_log_prob: torch.Tensor,
                                   rollout_log_prob: torch.Tensor | None, mask: torch.Tensor, tis_cap: float | None,
                                   tis_level: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(token_loss·w, TIS metrics), w = sg(min(exp(old − rollout), tis_cap)) per token, or per
    sequence from the sum over its valid tokens; (token_loss, {}) when tis_cap is None."""
    if tis_cap is None:
        return token_loss, {}
    mismatch_log_ratio = (old_log_prob - rollout_log_prob).masked_fill(~mask, 0.0)
    if tis_level == "sequence":
        mismatch_log_ratio = mismatch_log_ratio.sum(dim=-1, keepdim=True).expand_as(mismatch_log_ratio)
    mismatch_log_ratio = mismatch_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    raw_tis_weight = torch.exp(mismatch_log_ratio).detach()
    tis_weight = raw_tis_weight.clamp_max(tis_cap)
    metrics = {"tis_weight_mean": masked_mean(tis_weight, mask),
               "tis_clipfrac": masked_mean((raw_tis_weight > tis_cap).float(), mask)}
    return token_loss * tis_weight, metrics


def _as_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    # one device-to-host copy for all metrics instead of one sync per float()
    values = torch.stack([value.to(torch.float64) for value in metrics.values()]).tolist()
    return dict(zip(metrics, values))


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    ratio_level: str = "token",
    rollout_log_prob: torch.Tensor | None = None,
    tis_cap: float | None = None,
    tis_level: str = "token",
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    norm_length: Count | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate with asymmetric clip (DAPO clip-higher) and dual clip.

    ρ = exp(clamp(logp − old, −20, 20))   (ratio_level="sequence": GSPO, see below)
    L1 = −A·ρ,  L2 = −A·clip(ρ, 1 − clip_ratio_low, 1 + clip_ratio_high),  L = max(L1, L2)
    dual clip, A < 0:  L = min(L, −A·clip_ratio_c)   (bounds the loss of a token whose
    ratio exploded under a negative advantage)
    TIS (rollout_log_prob and tis_cap given): L ← L·w,  w = sg(min(exp(old − rollout), tis_cap))
    corrects for the rollout engine sampling from a different distribution than the trainer
    computes (kernels, precision; older weights in asynchronous training).
    tis_level="sequence": one weight per sequence, w_i = sg(min(exp(Σ_{valid t}(old_t − rollout_t)), tis_cap))
    (the product of its token ratios), on every token of it.
    loss = agg_loss(L, response_mask, loss_agg_mode, num_tokens, num_seqs, norm_length).

    GSPO (ratio_level="sequence"): every token of sequence i uses the sequence ratio
    s_i = exp(mean over valid t of (logp_t − old_t)) as its value, with gradient
    s_i·∇logp_t. Sequence ratios sit much closer to 1 than token ratios, so GSPO runs use
    far smaller clip ranges (the paper: 3e-4 / 4e-4).

    Inputs: log_prob (B, T) with gradient, old_log_prob / advantages / rollout_log_prob
    (B, T) constants, response_mask (B, T). Returns (scalar loss, metrics): pg_loss,
    clipfrac (clip active, L2 > L1), clipfrac_low (A < 0, ρ < 1 − low), clipfrac_high
    (A > 0, ρ > 1 + high), clipfrac_dual (dual bound active), ppo_kl (mean old − logp),
    and with TIS tis_weight_mean, tis_clipfrac (weights capped).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (the dual-clip bound; DAPO/verl use 3.0)")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; valid: {', '.join(RATIO_LEVELS)}")
    _check_tis(rollout_log_prob, tis_cap, tis_level)

    mask = response_mask.bool()
    ratio = _importance_ratio(log_prob, old_log_prob, mask, ratio_level)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    token_loss = torch.where(advantages < 0, torch.minimum(clip_loss, dual_bound), clip_loss)

    token_loss, tis_metrics = _truncated_importance_sampling(token_loss, old_log_prob, rollout_log_prob, mask, tis_cap,
                                                             tis_level)
    loss = agg_loss(token_loss, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)

    with torch.no_grad():
        metrics = {
            "pg_loss": masked_mean(token_loss, mask),
            "clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "clipfrac_low": masked_mean(((advantages < 0) & (ratio < 1.0 - clip_ratio_low)).float(), mask),
            "clipfrac_high": masked_mean(((advantages > 0) & (ratio > 1.0 + clip_ratio_high)).float(), mask),
            "clipfrac_dual": masked_mean(((advantages < 0) & (clip_loss > dual_bound)).float(), mask),
            "ppo_kl": masked_mean(old_log_prob - log_prob, mask),
        }
    return loss, _as_floats(metrics | tis_metrics)


@register_policy_loss("ppo")
def ppo_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, algo, *, rollout_log_prob: torch.Tensor | None = None,
                    num_tokens: Count | None = None, num_seqs: Count | None = None,
                    norm_length: Count | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """`policy_loss` with the run's settings: algorithm.clip_ratio_low / _high / _c,
    loss_agg_mode, ratio_level (GSPO), tis_cap and tis_level (TIS, when tis_cap is set)."""
    a = algo
    return policy_loss(log_prob, old_log_prob, advantages, mask, clip_ratio_low=a.clip_ratio_low,
                       clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode,
                       ratio_level=a.ratio_level, rollout_log_prob=rollout_log_prob, tis_cap=a.tis_cap,
                       tis_level=a.tis_level, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)


@register_policy_loss("cispo")
def cispo_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, algo, *, rollout_log_prob: torch.Tensor | None = None,
                      num_tokens: Count | None = None, num_seqs: Count | None = None,
                      norm_length: Count | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, never the gradient.

    ρ = exp(clamp(logp − old, −20, 20))   (algorithm.ratio_level="sequence": GSPO's s_i on every token)
    w = sg(clip(ρ, 1 − clip_ratio_low, 1 + clip_ratio_high))
    L = −w·A·logp,   so ∇L = −w·A·∇logp
    TIS as in `policy_loss` (algorithm.tis_cap, tis_level): L ← L·w_tis.
    loss = agg_loss(L, mask, algorithm.loss_agg_mode, num_tokens, num_seqs, norm_length)
    (the paper's is token-mean).

    PPO's clip drops the gradient of a token whose ratio left the clip range in the direction
    its advantage pushes; after the first update that is mostly rare tokens that fork the
    reasoning ("However", "Wait"). CISPO keeps every token's gradient and only bounds its
    weight. The paper sets no lower bound in practice (a large ε_low, here clip_ratio_low near
    1) and tunes ε_high (clip_ratio_high). algorithm.clip_ratio_c (dual clip) does not apply.

    Inputs as `policy_loss`, algo the run's AlgorithmConfig. Metrics: pg_loss (mean L),
    clipfrac (w ≠ ρ), clipfrac_low (ρ < 1 − low), clipfrac_high (ρ > 1 + high), ppo_kl, and
    with TIS tis_weight_mean, tis_clipfrac.
    """
    a = algo
    _check_tis(rollout_log_prob, a.tis_cap, a.tis_level)
    mask = mask.bool()
    ratio = _importance_ratio(log_prob, old_log_prob, mask, a.ratio_level).detach()
    low, high = 1.0 - a.clip_ratio_low, 1.0 + a.clip_ratio_high
    weight = ratio.clamp(low, high)
    token_loss, tis_metrics = _truncated_importance_sampling(-weight * advantages * log_prob, old_log_prob,
                                                             rollout_log_prob, mask, a.tis_cap, a.tis_level)
    loss = agg_loss(token_loss, mask, a.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    with torch.no_grad():
        metrics = {
            "pg_loss": masked_mean(token_loss, mask),
            "clipfrac": masked_mean((weight != ratio).float(), mask),
            "clipfrac_low": masked_mean((ratio < low).float(), mask),
            "clipfrac_high": masked_mean((ratio > high).float(), mask),
            "ppo_kl": masked_mean(old_log_prob - log_prob, mask),
        }
    return loss, _as_floats(metrics | tis_metrics)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    norm_length: Count | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss (PPO critic).

    V_clip = old + clamp(V − old, −c, c),  L = ½·max((V − R)², (V_clip − R)²),
    loss = agg_loss(L, response_mask, loss_agg_mode, ...). The clip keeps the critic from
    moving further than c from the values the advantages were computed with.
    values (B, T) with gradient, old_values / returns (B, T) constants, c = cliprange_value
    in value units. Metrics: vf_loss (mean L), vf_clipfrac (clipped branch larger),
    vpred_mean (mean V).
    """
    if cliprange_value <= 0:
        raise ValueError(f"cliprange_value={cliprange_value} must be > 0 (critic.cliprange_value)")
    mask = response_mask.bool()
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    token_loss = 0.5 * torch.maximum(unclipped_error, clipped_error)
    loss = agg_loss(token_loss, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    with torch.no_grad():
        metrics = {
            "vf_loss": masked_mean(token_loss, mask),
            "vf_clipfrac": masked_mean((clipped_error > unclipped_error).float(), mask),
            "vpred_mean": masked_mean(values, mask),
        }
    return loss, _as_floats(metrics)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, in nats.

    H = −Σ p·log p = logsumexp(z) − Σ softmax(z)·z. Computed on z − max(z) (H is
    shift-invariant) so that large logits neither overflow nor cancel two large terms.
    Logits of −inf (vocabulary masked out) have p = 0 and contribute 0, not 0·inf = NaN.
    logits (..., V) → (...,).
    """
    shifted = logits - logits.amax(dim=-1, keepdim=True).detach()
    probs = torch.softmax(shifted, dim=-1)
    finite_shifted = shifted.masked_fill(torch.isneginf(shifted), 0.0)
    return torch.logsumexp(shifted, dim=-1) - (probs * finite_shifted).sum(-1)
