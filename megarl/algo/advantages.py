"""Advantage estimators: GRPO / Dr.GRPO, RLOO, REINFORCE++ (with and without group
baseline) and GAE.

Outcome-reward estimators (GRPO, RLOO) take one scalar score per sequence, shape (B,),
and return one advantage per sequence; the caller broadcasts it over the response tokens
(`advantage[:, None] * response_mask`). Token-level estimators (REINFORCE++, GAE) take
(B, T) tensors aligned with the response tokens and return (advantages, returns), both
(B, T) and zero where the mask is 0.

Multi-turn responses (search agents) carry observation tokens with mask 0 in the middle
of a response. Token-level estimators skip them: such a position adds no reward and
does not count as a step of discounting, so the policy's own tokens form one chain.

Advantages are constants of the policy loss, so every estimator runs under no_grad.

At the end of the file, each estimator is registered under the name algorithm.adv_estimator
selects it by (megarl.algo.registry), as a thin adapter to its formula.
"""

from __future__ import annotations

import torch

from megarl.algo.groups import GroupIds, group_index, group_mean_std, group_sizes, group_sum
from megarl.algo.masked import masked_whiten, zero_outside_mask
from megarl.algo.registry import register_advantage_estimator


def _as_float(scores: torch.Tensor) -> torch.Tensor:
    # integer or half-precision scores would make group statistics lossy
    return scores.to(torch.promote_types(scores.dtype, torch.float32))


def _centre_by_group(scores: torch.Tensor, group_ids: GroupIds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(r − baseline, std_g, lone), each (B,): baseline = mean_g, or 0 for a sample alone
    in its group (it has nothing to be compared with, so it keeps its raw score)."""
    rewards = _as_float(scores)
    index, num_groups = group_index(group_ids, device=rewards.device)
    mean, std = group_mean_std(rewards, index, num_groups)
    lone = group_sizes(index, num_groups)[index] == 1
    return rewards - torch.where(lone, torch.zeros_like(mean), mean), std, lone


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """t at every position of a (B, T) mask."""
    return torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)


@torch.no_grad()
def compute_grpo_advantages(
    scores: torch.Tensor, group_ids: GroupIds, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (and Dr.GRPO) outcome advantage, one per sequence.

    A_i = (r_i − mean_g) / (std_g + eps)   (norm_by_std=True, GRPO)
    A_i =  r_i − mean_g                     (norm_by_std=False, Dr.GRPO)
    with g the group of sample i, mean_g and the Bessel-corrected std_g taken over the
    group's scores. A group of one sample has no baseline to compare with, so it keeps
    its raw score: A = r exactly (mean 0, std 1, no eps), as verl does.

    scores: (B,) float, reward units. group_ids: LongTensor (B,) or a sequence of B
    hashables (uids); groups may be uneven and interleaved. Returns (B,) float.
    """
    centred, std, lone = _centre_by_group(scores, group_ids)
    if not norm_by_std:
        return centred
    return centred / torch.where(lone, torch.ones_like(std), std + eps)


@torch.no_grad()
def compute_rloo_advantages(scores: torch.Tensor, group_ids: GroupIds) -> torch.Tensor:
    """RLOO outcome advantage: each sample's baseline is the mean of the others in its group.

    A_i = r_i − (S_g − r_i) / (n_g − 1),  S_g = Σ_{j in g} r_j  (= n_g/(n_g−1)·(r_i − mean_g)).
    A group of one sample has no other samples: A = r.

    scores: (B,) float; group_ids: LongTensor (B,) or a sequence of hashables. Returns (B,).
    """
    rewards = _as_float(scores)
    index, num_groups = group_index(group_ids, device=rewards.device)
    others_sum = group_sum(rewards, index, num_groups)[index] - rewards
    others_count = group_sizes(index, num_groups)[index] - 1
    baseline = others_sum / others_count.clamp_min(1).to(rewards.dtype)
    return torch.where(others_count > 0, rewards - baseline, rewards)


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score on the last valid response token.

    rewards[i, t] = scores[i] if t = max{t : m[i, t] = 1}, else 0. Rows without any valid
    token get no reward. scores (B,), response_mask (B, T) → (B, T) float.
    """
    valid = response_mask.bool()
    last_valid = torch.where(valid, _positions(valid), -1).amax(dim=-1)
    rewards = torch.zeros(valid.shape, dtype=_as_float(scores).dtype, device=scores.device)
    rows = torch.nonzero(last_valid >= 0).squeeze(-1)
    rewards[rows, last_valid[rows]] = _as_float(scores)[rows]
    return rewards


def _discounted_sum_over_valid(values: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """G_t = x_t + discount·G_next, where "next" is the next position with mask 1.

    Masked positions add nothing and do not discount: G carries across them unchanged
    (they hold the value of the next valid position; callers mask them out).
    discount = 1 (the default γ = λ = 1) is a reverse cumulative sum; otherwise a loop over
    T, each step vectorised over the batch.
    """
    if discount == 1.0:
        return zero_outside_mask(values, mask).flip(-1).cumsum(-1).flip(-1)
    valid = mask.bool()
    out = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[-1])):
        running = torch.where(valid[:, t], values[:, t] + discount * running, running)
        out[:, t] = running
    return out


@torch.no_grad()
def compute_reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return over valid tokens, whitened over the batch.

    G_t = r_t + γ·G_next  (next = next valid token; G after the last valid token is 0)
    A   = masked_whiten(G)  over all valid tokens of the batch.
    Masked tokens (padding, observations inside a multi-turn response) neither add their
    reward nor break the chain. token_level_rewards, response_mask: (B, T).
    Returns (advantages, returns), each (B, T), zero where the mask is 0.
    """
    rewards = _as_float(token_level_rewards)
    returns = _discounted_sum_over_valid(rewards, response_mask, gamma)
    returns = zero_outside_mask(returns, response_mask)
    return masked_whiten(returns, response_mask), returns


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantages(
    scores: torch.Tensor, group_ids: GroupIds, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline, then whitened over the batch.

    R_i = r_i − mean_g (a size-1 group has baseline 0, so R = r);
    returns[i, t] = R_i·m[i, t];  A = masked_whiten(returns) over all valid tokens.
    scores (B,), group_ids LongTensor (B,) or hashables, response_mask (B, T).
    Returns (advantages, returns), each (B, T).
    """
    centred, _, _ = _centre_by_group(scores, group_ids)
    returns = centred[:, None] * response_mask.to(centred.dtype)
    return masked_whiten(returns, response_mask), returns


def _value_at_next_valid(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """V_next[i, t] = values[i, s] with s the first position > t where mask is 1, else 0."""
    valid = mask.bool()
    num_positions = valid.shape[-1]
    marked = torch.where(valid, _positions(valid), num_positions)
    # smallest valid position ≥ t (reverse running min), then shift by one for "> t"
    first_at_or_after = marked.flip(-1).cummin(-1).values.flip(-1)
    next_valid = torch.cat([first_at_or_after[:, 1:], torch.full_like(marked[:, :1], num_positions)], dim=-1)
    gathered = values.gather(-1, next_valid.clamp_max(num_positions - 1))
    return torch.where(next_valid < num_positions, gathered, torch.zeros_like(gathered))


@torch.no_grad()
def compute_gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the valid tokens of each response.

    δ_t = r_t + γ·V_next − V_t,   A_t = δ_t + γλ·A_next,   returns_t = A_t + V_t,
    where "next" is the next position with mask 1 (observation tokens are skipped);
    after the last valid token V_next = 0 and A_next = 0. When whiten=True the
    advantages are whitened over all valid tokens of the batch; returns use the raw A.
    token_level_rewards, values, response_mask: (B, T); values are the critic's V(s_t).
    Returns (advantages, returns), each (B, T), zero where the mask is 0.
    """
    rewards = _as_float(token_level_rewards)
    values = values.to(rewards.dtype)
    deltas = rewards + gamma * _value_at_next_valid(values, response_mask) - values
    raw_advantages = _discounted_sum_over_valid(deltas, response_mask, gamma * lam)
    returns = zero_outside_mask(raw_advantages + values, response_mask)
    advantages = masked_whiten(raw_advantages, response_mask) if whiten else zero_outside_mask(raw_advantages, response_mask)
    return advantages, returns


# The registered estimators (megarl.algo.registry): thin adapters from what the trainer has
# (scores, group ids, the padded batch, the algorithm settings) to the formulas above.


@register_advantage_estimator("grpo", kind="outcome", needs_groups=True)
def grpo_estimator(scores: torch.Tensor, groups: torch.Tensor, algo) -> torch.Tensor:
    """GRPO, or Dr.GRPO with algorithm.norm_adv_by_std=false."""
    return compute_grpo_advantages(scores, groups, norm_by_std=algo.norm_adv_by_std)


@register_advantage_estimator("rloo", kind="outcome", needs_groups=True)
def rloo_estimator(scores: torch.Tensor, groups: torch.Tensor, algo) -> torch.Tensor:
    return compute_rloo_advantages(scores, groups)


@register_advantage_estimator("reinforce_plus_plus", kind="token")
def reinforce_plus_plus_estimator(batch, token_rewards: torch.Tensor, scores: torch.Tensor, groups: torch.Tensor,
                                  algo) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted by algorithm.gamma."""
    return compute_reinforce_plus_plus_advantages(token_rewards, batch.loss_mask, algo.gamma)


@register_advantage_estimator("reinforce_plus_plus_baseline", kind="token", needs_groups=True)
def reinforce_plus_plus_baseline_estimator(batch, token_rewards: torch.Tensor, scores: torch.Tensor,
                                           groups: torch.Tensor, algo) -> tuple[torch.Tensor, torch.Tensor]:
    """From the scores alone: token_rewards (and a KL penalty in them) are not used."""
    return compute_reinforce_plus_plus_baseline_advantages(scores, groups, batch.loss_mask)


@register_advantage_estimator("gae", kind="token", needs_critic=True)
def gae_estimator(batch, token_rewards: torch.Tensor, scores: torch.Tensor, groups: torch.Tensor,
                  algo) -> tuple[torch.Tensor, torch.Tensor]:
    """Over the critic's values (batch.values), with algorithm.gamma and algorithm.lam."""
    if batch.values is None:
        raise ValueError("the gae estimator needs batch.values from the critic")
    return compute_gae_advantages(token_rewards, batch.values, batch.loss_mask, algo.gamma, algo.lam)
