"""Policy loss (clip-higher, dual clip, GSPO, TIS), value loss and entropy
(megarl.algo.policy_loss)."""

import math

import pytest
import torch

from megarl.algo import entropy_from_logits, policy_loss, value_loss

LOW, HIGH, C = 0.2, 0.28, 3.0

# (advantage, ratio, expected loss L, d L / d logp, clip, clip_low, clip_high, dual)
# L1 = −A·ρ, L2 = −A·clip(ρ, 0.8, 1.28), L = max(L1, L2), and for A < 0: min(L, 3·(−A)).
# d L1 / d logp = −A·ρ (since dρ/dlogp = ρ); the clipped and dual branches have no gradient.
TOKEN_CASES = [
    (1.0, 1.0, -1.0, -1.0, 0, 0, 0, 0),  # inside the range
    (1.0, 1.5, -1.28, 0.0, 1, 0, 1, 0),  # A > 0, above 1 + high: clipped to −1.28
    (1.0, 0.5, -0.5, -0.5, 0, 0, 0, 0),  # A > 0, below 1 − low: L1 = −0.5 > L2 = −0.8, no clip
    (-1.0, 0.5, 0.8, 0.0, 1, 1, 0, 0),  # A < 0, below 1 − low: clipped to 0.8
    (-1.0, 1.5, 1.5, 1.5, 0, 0, 0, 0),  # A < 0, above 1 + high: L1 = 1.5 > L2 = 1.28, below 3
    (-1.0, 5.0, 3.0, 0.0, 0, 0, 0, 1),  # A < 0, ratio exploded: min(5, 3·1) = 3, dual clip
    (-2.0, 1.1, 2.2, 2.2, 0, 0, 0, 0),  # A < 0 inside: −(−2)·1.1
    (0.5, 1.2, -0.6, -0.6, 0, 0, 0, 0),  # A > 0 inside
]


def _single_token_call(advantage, ratio, **kwargs):
    log_prob = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        log_prob,
        torch.zeros(1, 1, dtype=torch.float64),
        torch.tensor([[advantage]], dtype=torch.float64),
        torch.ones(1, 1),
        clip_ratio_low=LOW,
        clip_ratio_high=HIGH,
        clip_ratio_c=C,
        **kwargs,
    )
    loss.backward()
    return loss, log_prob.grad, metrics


@pytest.mark.parametrize("advantage, ratio, expected, grad, clip, clip_low, clip_high, dual", TOKEN_CASES)
def test_policy_loss_per_token(advantage, ratio, expected, grad, clip, clip_low, clip_high, dual):
    loss, log_prob_grad, metrics = _single_token_call(advantage, ratio)
    assert loss.item() == pytest.approx(expected)
    assert log_prob_grad.item() == pytest.approx(grad)
    assert metrics["pg_loss"] == pytest.approx(expected)
    assert (metrics["clipfrac"], metrics["clipfrac_low"], metrics["clipfrac_high"], metrics["clipfrac_dual"]) == (
        clip,
        clip_low,
        clip_high,
        dual,
    )
    assert metrics["ppo_kl"] == pytest.approx(-math.log(ratio))


def test_policy_loss_batch_metrics_are_means_over_valid_tokens():
    advantages = [case[0] for case in TOKEN_CASES] + [100.0]  # last token is padding
    ratios = [case[1] for case in TOKEN_CASES] + [50.0]
    log_prob = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64)
    mask = torch.tensor([[1] * len(TOKEN_CASES) + [0]])
    loss, metrics = policy_loss(log_prob, torch.zeros_like(log_prob), torch.tensor([advantages], dtype=torch.float64), mask)
    n = len(TOKEN_CASES)
    assert loss.item() == pytest.approx(sum(case[2] for case in TOKEN_CASES) / n)
    assert metrics["clipfrac"] == pytest.approx(2 / n)
    assert metrics["clipfrac_low"] == pytest.approx(1 / n)
    assert metrics["clipfrac_high"] == pytest.approx(1 / n)
    assert metrics["clipfrac_dual"] == pytest.approx(1 / n)
    assert metrics["ppo_kl"] == pytest.approx(-sum(math.log(case[1]) for case in TOKEN_CASES) / n)
    assert all(isinstance(value, float) for value in metrics.values())


@pytest.mark.parametrize("clip_ratio_c", [1.0, 0.5])
def test_policy_loss_rejects_dual_clip_bound_not_above_one(clip_ratio_c):
    ones = torch.ones(1, 1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(ones, ones, ones, ones, clip_ratio_c=clip_ratio_c)


def test_gspo_uses_the_sequence_ratio_with_per_token_gradient():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 4, generator=gen, dtype=torch.float64)
    log_prob = (old + 0.1 * torch.randn(2, 4, generator=gen, dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])  # padding and a hole
    advantages = torch.tensor([[1.0, 1.0, 1.0, 9.0], [-0.5, 9.0, -0.5, -0.5]], dtype=torch.float64)
    # s_i = exp(mean over valid t of (logp − old)), by a plain loop
    seq_ratio = []
    for i in range(2):
        diffs = [(log_prob[i, t] - old[i, t]).item() for t in range(4) if mask[i, t]]
        seq_ratio.append(math.exp(sum(diffs) / len(diffs)))
    # wide clip range: nothing clips, so L_t = −A_t·s_i and dL/dlogp_t = −A_t·s_i / N_tok
    loss, metrics = policy_loss(log_prob, old, advantages, mask, clip_ratio_low=0.9, clip_ratio_high=10.0, ratio_level="sequence")
    loss.backward()
    num_tokens = 6
    expected_loss = sum(-advantages[i, t].item() * seq_ratio[i] for i in range(2) for t in range(4) if mask[i, t]) / num_tokens
    expected_grad = [[-advantages[i, t].item() * seq_ratio[i] / num_tokens if mask[i, t] else 0.0 for t in range(4)] for i in range(2)]
    assert loss.item() == pytest.approx(expected_loss)
    torch.testing.assert_close(log_prob.grad, torch.tensor(expected_grad, dtype=torch.float64))
    assert metrics["clipfrac"] == 0.0


def test_gspo_clips_whole_sequences():
    # row 0: logp − old = [0.5, 0.1] → s = exp(0.3) ≈ 1.35 > 1.28 with A > 0: both tokens clipped,
    # although token 1 alone (ratio exp(0.1) ≈ 1.105) would not be. Row 1: s = 1, inside.
    old = torch.zeros(2, 2, dtype=torch.float64)
    log_prob = torch.tensor([[0.5, 0.1], [0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.ones(2, 2, dtype=torch.float64)
    loss, metrics = policy_loss(log_prob, old, advantages, torch.ones(2, 2), ratio_level="sequence")
    loss.backward()
    assert loss.item() == pytest.approx((2 * -1.28 + 2 * -1.0) / 4)
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.0], [-0.25, -0.25]], dtype=torch.float64))
    assert metrics["clipfrac_high"] == pytest.approx(0.5)


def test_truncated_importance_sampling_weights_each_token():
    # ratio 1, A = 1 → L_t = −w_t; w = min(exp(old − rollout), 2): exp(0) = 1, exp(1) → cap 2, exp(−1)
    old = torch.zeros(1, 4, dtype=torch.float64)
    rollout = torch.tensor([[0.0, -1.0, 1.0, 5.0]], dtype=torch.float64)  # last token is padding
    log_prob = old.clone().requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0]])
    weights = [1.0, 2.0, math.exp(-1.0)]
    loss, metrics = policy_loss(log_prob, old, torch.ones(1, 4, dtype=torch.float64), mask, rollout_log_prob=rollout, tis_cap=2.0)
    loss.backward()
    assert loss.item() == pytest.approx(-sum(weights) / 3)
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-w / 3 for w in weights] + [0.0]], dtype=torch.float64))
    assert metrics["tis_weight_mean"] == pytest.approx(sum(weights) / 3)
    assert metrics["tis_clipfrac"] == pytest.approx(1 / 3)


def test_tis_needs_rollout_log_probs():
    ones = torch.ones(1, 1)
    with pytest.raises(ValueError, match="rollout_log_prob"):
        policy_loss(ones, ones, ones, ones, tis_cap=2.0)
    _, metrics = policy_loss(ones, ones, ones, ones, rollout_log_prob=ones)  # no cap: TIS off
    assert "tis_weight_mean" not in metrics


# (V, old V, return, L, dL/dV, clipped) with c = 0.2: V_clip = old + clamp(V − old, ±0.2)
VALUE_CASES = [
    (1.0, 0.5, 1.0, 0.5 * (0.7 - 1.0) ** 2, 0.0, 1),  # moved too far toward R: clipped error 0.09 wins
    (0.6, 0.5, 1.0, 0.5 * 0.4**2, -0.4, 0),  # inside the clip range: both errors equal
    (0.0, 0.5, 1.0, 0.5 * 1.0**2, -1.0, 0),  # moved away from R: unclipped error 1 > 0.49
    (1.5, 1.0, 0.0, 0.5 * 1.5**2, 1.5, 0),  # unclipped 2.25 > clipped 1.44
]


@pytest.mark.parametrize("v, old, ret, expected, grad, clipped", VALUE_CASES)
def test_value_loss_per_token(v, old, ret, expected, grad, clipped):
    values = torch.tensor([[v]], dtype=torch.float64, requires_grad=True)
    to_t = lambda x: torch.tensor([[x]], dtype=torch.float64)  # noqa: E731
    loss, metrics = value_loss(values, to_t(old), to_t(ret), torch.ones(1, 1), cliprange_value=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(expected)
    assert values.grad.item() == pytest.approx(grad)
    assert metrics == pytest.approx({"vf_loss": expected, "vf_clipfrac": clipped, "vpred_mean": v})


def test_value_loss_batch_ignores_padding():
    rows = [case[:3] for case in VALUE_CASES]
    values, old, ret = (torch.tensor([[r[k] for r in rows] + [7.0]], dtype=torch.float64) for k in range(3))
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = value_loss(values, old, ret, mask, cliprange_value=0.2, loss_agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(sum(case[3] for case in VALUE_CASES))  # one sequence
    assert metrics["vf_clipfrac"] == pytest.approx(1 / 4)
    assert metrics["vpred_mean"] == pytest.approx((1.0 + 0.6 + 0.0 + 1.5) / 4)


def reference_entropy(row):
    top = max(row)
    weights = [math.exp(z - top) for z in row if z != -math.inf]
    total = sum(weights)
    return -sum(w / total * math.log(w / total) for w in weights)


@pytest.mark.parametrize(
    "logits",
    [
        [0.0, 0.0, 0.0, 0.0],  # uniform: log 4
        [1.0, 2.0, 3.0],
        [10000.0, 10001.0, 9999.0],  # huge logits must not overflow or cancel
        [-50.0, 3.0, 2.5, -1.0],
        [1.0, -math.inf, 2.0],  # masked vocabulary entry contributes nothing
    ],
)
def test_entropy_matches_minus_sum_p_log_p(logits):
    result = entropy_from_logits(torch.tensor([logits]))
    assert result.shape == (1,)
    assert result.item() == pytest.approx(reference_entropy(logits), abs=1e-5)


def test_entropy_keeps_leading_dims():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = [[reference_entropy(logits[i, t].tolist()) for t in range(3)] for i in range(2)]
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor(expected, dtype=torch.float64))
