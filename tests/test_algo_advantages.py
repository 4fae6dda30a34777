"""Advantage estimators (megarl.algo.advantages), checked against hand arithmetic and
slow per-sample Python loops."""

import math
import random
import statistics

import pytest
import torch

from megarl.algo import (
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_rloo_advantages,
    scores_to_token_rewards,
)

# Uneven, interleaved groups plus a lone sample:
#   a: indices 0, 2, 4 → scores 1, 0, 3 (mean 4/3, sample std sqrt(7/3))
#   b: indices 1, 5    → scores 2, 5    (mean 3.5, sample std sqrt(4.5))
#   c: index 3         → score 4        (alone)
SCORES = [1.0, 2.0, 0.0, 4.0, 3.0, 5.0]
UIDS = ["a", "b", "a", "c", "a", "b"]


def reference_grpo(scores, ids, norm_by_std=True, eps=1e-6):
    out = []
    for score, gid in zip(scores, ids):
        members = [s for s, g in zip(scores, ids) if g == gid]
        if len(members) == 1:
            out.append(score)
            continue
        centred = score - statistics.mean(members)
        out.append(centred / (statistics.stdev(members) + eps) if norm_by_std else centred)
    return out


def reference_whiten(values_and_mask_rows, eps=1e-8):
    flat = [v for row, mrow in values_and_mask_rows for v, m in zip(row, mrow) if m]
    mean, var = statistics.mean(flat), statistics.variance(flat)
    return [[(v - mean) / math.sqrt(var + eps) if m else 0.0 for v, m in zip(row, mrow)] for row, mrow in values_and_mask_rows]


def test_grpo_by_hand():
    sa, sb = math.sqrt(7 / 3), math.sqrt(4.5)
    eps = 1e-6
    expected = [
        (1 - 4 / 3) / (sa + eps),
        (2 - 3.5) / (sb + eps),
        (0 - 4 / 3) / (sa + eps),
        4.0,  # lone sample keeps its score
        (3 - 4 / 3) / (sa + eps),
        (5 - 3.5) / (sb + eps),
    ]
    result = compute_grpo_advantages(torch.tensor(SCORES, dtype=torch.float64), UIDS)
    torch.testing.assert_close(result, torch.tensor(expected, dtype=torch.float64))


def test_dr_grpo_drops_the_std():
    expected = [1 - 4 / 3, 2 - 3.5, 0 - 4 / 3, 4.0, 3 - 4 / 3, 5 - 3.5]
    result = compute_grpo_advantages(torch.tensor(SCORES, dtype=torch.float64), UIDS, norm_by_std=False)
    torch.testing.assert_close(result, torch.tensor(expected, dtype=torch.float64))


def test_grpo_constant_group_gives_zero_not_nan():
    result = compute_grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0]), [0, 0, 0, 1, 1])
    # group 1: [0, 1] → mean 0.5, std sqrt(0.5)
    expected = [0.0, 0.0, 0.0, -0.5 / (math.sqrt(0.5) + 1e-6), 0.5 / (math.sqrt(0.5) + 1e-6)]
    torch.testing.assert_close(result, torch.tensor(expected))


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_slow_reference_on_a_large_shuffled_batch(norm_by_std):
    rng = random.Random(0)
    ids = [rng.randrange(60) for _ in range(500)]  # uneven sizes, interleaved, some lone
    scores = [rng.choice([0.0, 1.0, 0.5, rng.random()]) for _ in ids]
    expected = reference_grpo(scores, ids, norm_by_std)
    for group_ids in (ids, torch.tensor(ids)):
        result = compute_grpo_advantages(torch.tensor(scores, dtype=torch.float64), group_ids, norm_by_std)
        torch.testing.assert_close(result, torch.tensor(expected, dtype=torch.float64))


def test_rloo_by_hand():
    # a: 1 − (0+3)/2 = −0.5,  0 − (1+3)/2 = −2,  3 − (1+0)/2 = 2.5;  b: 2 − 5 = −3, 5 − 2 = 3;  c: alone → 4
    expected = [-0.5, -3.0, -2.0, 4.0, 2.5, 3.0]
    result = compute_rloo_advantages(torch.tensor(SCORES), UIDS)
    torch.testing.assert_close(result, torch.tensor(expected))


@pytest.mark.parametrize(
    "scores, mask, expected",
    [
        # row 0 ends before padding; row 1 has no valid token; row 2 has a hole (observation)
        ([2.0, 3.0, 4.0], [[1, 1, 0], [0, 0, 0], [1, 0, 1]], [[0, 2, 0], [0, 0, 0], [0, 0, 4]]),
        ([-1.0], [[1, 1, 1]], [[0, 0, -1]]),
    ],
)
def test_scores_to_token_rewards(scores, mask, expected):
    result = scores_to_token_rewards(torch.tensor(scores), torch.tensor(mask))
    torch.testing.assert_close(result, torch.tensor(expected, dtype=torch.float32))


@pytest.mark.parametrize(
    "gamma, expected_returns",
    [
        # row 0: G_4 = 1, G_1 = 0 + 0.5·G_4 = 0.5 (2, 3 skipped), G_0 = 0.25;  row 1: G = 0.5, 1, 2
        (0.5, [[0.25, 0.5, 0, 0, 1, 0], [0.5, 1, 2, 0, 0, 0]]),
        # γ = 1: every valid token gets the sum of the rewards at and after it
        (1.0, [[1, 1, 0, 0, 1, 0], [2, 2, 2, 0, 0, 0]]),
    ],
)
def test_reinforce_plus_plus_skips_observation_tokens(gamma, expected_returns):
    # row 0: tokens 2, 3 are retrieved observations (mask 0, their reward 9 must be ignored),
    #        token 5 is padding (its reward 7 too)
    rewards = torch.tensor([[0, 0, 9, 9, 1, 7], [0, 0, 2, 0, 0, 0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]])
    advantages, returns = compute_reinforce_plus_plus_advantages(rewards, mask, gamma)
    torch.testing.assert_close(returns, torch.tensor(expected_returns, dtype=torch.float64))
    expected_adv = reference_whiten(list(zip(expected_returns, mask.tolist())))
    torch.testing.assert_close(advantages, torch.tensor(expected_adv, dtype=torch.float64))


def test_reinforce_plus_plus_baseline_by_hand():
    # a: [1, 3] mean 2 → −1, +1;  b: [2, 2] → 0, 0;  c: alone → 7 (baseline 0)
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0, 7.0], dtype=torch.float64)
    ids = ["a", "a", "b", "b", "c"]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [0, 1, 1]])
    centred = [-1.0, 1.0, 0.0, 0.0, 7.0]
    expected_returns = [[c * m for m in row] for c, row in zip(centred, mask.tolist())]
    advantages, returns = compute_reinforce_plus_plus_baseline_advantages(scores, ids, mask)
    torch.testing.assert_close(returns, torch.tensor(expected_returns, dtype=torch.float64))
    expected_adv = reference_whiten(list(zip(expected_returns, mask.tolist())))
    torch.testing.assert_close(advantages, torch.tensor(expected_adv, dtype=torch.float64))


def reference_gae(rewards, values, mask, gamma, lam):
    """Per row: keep the valid positions, run textbook GAE on them, put results back."""
    advantages, returns = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        valid = [t for t, m in enumerate(m_row) if m]
        adv_row, ret_row = [0.0] * len(m_row), [0.0] * len(m_row)
        next_value, next_adv = 0.0, 0.0
        for t in reversed(valid):
            delta = r_row[t] + gamma * next_value - v_row[t]
            next_adv = delta + gamma * lam * next_adv
            next_value = v_row[t]
            adv_row[t], ret_row[t] = next_adv, next_adv + v_row[t]
        advantages.append(adv_row)
        returns.append(ret_row)
    return advantages, returns


def test_gae_by_hand_with_observation_hole():
    gamma, lam = 0.9, 0.8
    # token 1 is an observation (reward 5, value 9 ignored), token 3 padding.
    # t=2 (last valid): δ = 1 + 0 − 0.2 = 0.8, A = 0.8, return 1.0
    # t=0: next valid is 2: δ = 0 + 0.9·0.2 − 0.5 = −0.32, A = −0.32 + 0.72·0.8 = 0.256, return 0.756
    rewards = torch.tensor([[0.0, 5.0, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 9.0, 0.2, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1, 0]])
    advantages, returns = compute_gae_advantages(rewards, values, mask, gamma, lam, whiten=False)
    torch.testing.assert_close(advantages, torch.tensor([[0.256, 0, 0.8, 0]], dtype=torch.float64))
    torch.testing.assert_close(returns, torch.tensor([[0.756, 0, 1.0, 0]], dtype=torch.float64))


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_slow_reference(gamma, lam):
    gen = torch.Generator().manual_seed(1)
    batch, length = 5, 12
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) > 0.3).long()
    mask[:, -3:] = 0  # trailing padding
    mask[4] = 0  # an empty row
    ref_adv, ref_ret = reference_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    raw, returns = compute_gae_advantages(rewards, values, mask, gamma, lam, whiten=False)
    torch.testing.assert_close(raw, torch.tensor(ref_adv, dtype=torch.float64))
    torch.testing.assert_close(returns, torch.tensor(ref_ret, dtype=torch.float64))
    whitened, _ = compute_gae_advantages(rewards, values, mask, gamma, lam, whiten=True)
    torch.testing.assert_close(whitened, torch.tensor(reference_whiten(list(zip(ref_adv, mask.tolist()))), dtype=torch.float64))


def test_gae_with_zero_values_and_lambda_one_is_the_discounted_return():
    # V ≡ 0, λ = 1: A_t = Σ γ^k r_{t+k} over valid tokens = REINFORCE++ return
    gen = torch.Generator().manual_seed(2)
    rewards = torch.randn(3, 7, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1, 1, 0, 0], [1] * 7, [0, 1, 1, 0, 0, 1, 0]])
    gae, _ = compute_gae_advantages(rewards, torch.zeros_like(rewards), mask, 0.9, 1.0, whiten=False)
    _, returns = compute_reinforce_plus_plus_advantages(rewards, mask, 0.9)
    torch.testing.assert_close(gae, returns)
