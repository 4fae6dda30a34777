"""The edges of megarl/algo that mutation testing (`make mutants`) found unchecked: the bounds
that keep a ratio finite, the strict inequalities of the clip metrics at their boundary, the
clipped value loss with old values away from 0, sequence-level TIS, the counts a caller passes
through, dtypes kept, and the wording of every error a bad setting gets. Each expected value is
worked out by hand in the test."""

from __future__ import annotations

import math
import re

import pytest
import torch

from megarl.algo.advantages import (
    _positions,
    compute_gae_advantages,
    compute_grpo_advantages,
    scores_to_token_rewards,
)
from megarl.algo.groups import group_index
from megarl.algo.aggregation import agg_loss
from megarl.algo.dynamic_sampling import DynamicSamplingError, InformativeGroupBuffer, informative_group_mask
from megarl.algo.kl import kl_penalty
from megarl.algo.masked import masked_var, masked_whiten, zero_outside_mask
from megarl.algo.overlong import overlong_penalty
from megarl.algo.policy_loss import entropy_from_logits, policy_loss, value_loss

F64 = torch.float64


def t(*rows, dtype=F64):
    return torch.tensor(rows, dtype=dtype)


def loss_of(log_ratio: float, advantage: float, **kw) -> tuple[float, dict]:
    """policy_loss of one token whose log-prob is old + log_ratio."""
    lp = torch.tensor([[log_ratio]], dtype=F64, requires_grad=True)
    loss, metrics = policy_loss(lp, t([0.0]), t([advantage]), torch.ones(1, 1), **kw)
    return loss, metrics


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_a_ratio_that_overflows_is_bounded_so_a_zero_advantage_stays_zero(ratio_level):
    # log-ratio 1000: exp overflows; unbounded, −0·inf = NaN would poison the step
    loss, _ = loss_of(1000.0, 0.0, ratio_level=ratio_level)
    assert loss.item() == 0.0
    loss.backward()
    assert not math.isnan(loss.item())


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_a_vanishing_ratio_is_bounded_below_at_exp_minus_20(ratio_level):
    # A = 1, ρ below the clip range: L = max(−ρ, −0.8) = −ρ, ρ = exp(−20) (not exp(−30))
    loss, _ = loss_of(-30.0, 1.0, ratio_level=ratio_level)
    assert loss.item() == pytest.approx(-math.exp(-20.0), rel=1e-12)


def test_the_clip_metrics_count_strictly_inside_their_region():
    # zero clip range, ρ = 1 exactly: neither clipped low nor high; A = 0 counts nowhere
    for advantage in (-1.0, 1.0):
        _, m = loss_of(0.0, advantage, clip_ratio_low=0.0, clip_ratio_high=0.0)
        assert (m["clipfrac_low"], m["clipfrac_high"]) == (0.0, 0.0)
    _, m = loss_of(math.log(0.5), 0.0)  # ρ = 0.5 < 0.8 but A = 0
    assert m["clipfrac_low"] == 0.0
    _, m = loss_of(math.log(2.0), 0.0)  # ρ = 2 > 1.28 but A = 0
    assert m["clipfrac_high"] == 0.0
    _, m = loss_of(math.log(0.5), -1.0)  # A < 0, ρ < 0.8: clipped low
    assert m["clipfrac_low"] == 1.0


def test_the_dual_clip_counts_only_a_loss_above_its_bound():
    rho = torch.exp(torch.tensor(1.5, dtype=F64)).item()  # A = −1: clip loss = ρ
    _, m = loss_of(1.5, -1.0, clip_ratio_c=rho)  # exactly at the bound: not active
    assert m["clipfrac_dual"] == 0.0
    _, m = loss_of(1.5, -1.0, clip_ratio_c=rho * 0.99)
    assert m["clipfrac_dual"] == 1.0


def test_tis_at_exactly_its_cap_is_not_counted_as_capped():
    lp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    _, m = policy_loss(lp, t([0.0, 0.0]), t([1.0, 1.0]), torch.ones(1, 2), rollout_log_prob=t([0.0, 0.0]), tis_cap=1.0)
    assert (m["tis_clipfrac"], m["tis_weight_mean"]) == (0.0, 1.0)


def test_a_tis_weight_below_exp_minus_20_is_bounded():
    lp = torch.zeros(1, 1, dtype=F64, requires_grad=True)
    _, m = policy_loss(lp, t([0.0]), t([1.0]), torch.ones(1, 1), rollout_log_prob=t([30.0]), tis_cap=2.0)
    assert m["tis_weight_mean"] == pytest.approx(math.exp(-20.0), rel=1e-12)


def test_sequence_level_tis_weighs_every_token_by_the_product_over_valid_tokens():
    # row 0: old − rollout = 0.1, 0.2 (valid), 5.0 in padding (ignored): w = exp(0.3) on both tokens
    # row 1: 0.5, 0.6, 0.7 all valid: exp(1.8) = 6.05, capped at 2
    old = t([0.1, 0.2, 5.0], [0.5, 0.6, 0.7])
    rollout = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    advantages = t([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    lp = old.clone().requires_grad_(True)  # ρ = 1: token loss −A·w
    loss, m = policy_loss(lp, old, advantages, mask, rollout_log_prob=rollout, tis_cap=2.0, tis_level="sequence")
    w0 = math.exp(0.3)
    assert m["tis_weight_mean"] == pytest.approx((2 * w0 + 3 * 2.0) / 5, rel=1e-12)
    assert m["tis_clipfrac"] == pytest.approx(3 / 5)
    assert loss.item() == pytest.approx(-(2 * w0 + 3 * 2.0) / 5, rel=1e-12)


@pytest.mark.parametrize("v, old, ret, expected, clipfrac", [
    (5.0, 2.0, 0.0, 12.5, 0.0),  # V_clip = 3: ½·max(25, 9)
    (1.0, 2.0, 0.9, 0.18, 1.0),  # V_clip = 1.5: ½·max(0.01, 0.36)
    (3.5, 2.0, 2.5, 0.5, 0.0),   # V_clip = 2.5: ½·max(1, 0)
])
def test_value_loss_clips_around_the_old_values(v, old, ret, expected, clipfrac):
    loss, m = value_loss(t([v]).requires_grad_(True), t([old]), t([ret]), torch.ones(1, 1), cliprange_value=0.5)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["vf_clipfrac"] == clipfrac


@pytest.mark.parametrize("mode, counts, denominator", [
    ("token-mean", {"num_tokens": 10}, 10),
    ("seq-mean-token-sum", {"num_seqs": 4}, 4),
    ("seq-mean-token-sum-norm", {"num_seqs": 4, "norm_length": 5}, 20),
])
def test_value_loss_takes_the_callers_counts(mode, counts, denominator):
    # one token, V = 2, R = 0, old = 2: L = ½·4 = 2, over the given denominator
    loss, _ = value_loss(t([2.0]).requires_grad_(True), t([2.0]), t([0.0]), torch.ones(1, 1), 1.0, mode, **counts)
    assert loss.item() == pytest.approx(2.0 / denominator)


def test_seq_mean_token_mean_divides_a_one_token_sequence_by_one():
    loss = agg_loss(t([3.0, 9.0]), torch.tensor([[1, 0]]), "seq-mean-token-mean")
    assert loss.item() == 3.0


def test_masked_var_is_bessel_corrected_for_two_values_and_whiten_of_a_constant_is_zero():
    assert masked_var(t([1.0, 3.0, 100.0]), torch.tensor([[1, 1, 0]])).item() == 2.0
    assert masked_whiten(t([4.0, 4.0, 4.0]), torch.ones(1, 3)).tolist() == [[0.0, 0.0, 0.0]]


def test_zero_outside_mask_keeps_an_integer_dtype():
    out = zero_outside_mask(torch.tensor([[3, 4]]), torch.tensor([[1, 0]]))
    assert out.dtype == torch.int64 and out.tolist() == [[3, 0]]


def test_the_overlong_penalty_scales_by_the_factor_and_takes_a_one_token_buffer():
    lengths = torch.tensor([8, 9, 10])
    assert overlong_penalty(lengths, 10, 2, penalty_factor=2.0).tolist() == [0.0, -1.0, -2.0]
    assert overlong_penalty(10, 10, 1) == -1.0


def test_the_k3_gradient_stays_finite_where_exp_overflows():
    logp = torch.tensor([[-1000.0, 0.0]], requires_grad=True)  # ref − logp = 1000: e^1000 = inf in float32
    kl = kl_penalty(logp, torch.zeros(1, 2), "k3")
    assert kl[0, 0].item() == 10.0
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_a_single_valid_token_at_position_0_gets_the_score_in_the_scores_dtype():
    rewards = scores_to_token_rewards(t(2.5, 1.0), torch.tensor([[1, 0, 0], [0, 1, 1]]))
    assert rewards.dtype == F64 and rewards.tolist() == [[2.5, 0.0, 0.0], [0.0, 0.0, 1.0]]


def test_positions_are_on_the_masks_device():
    assert _positions(torch.ones(2, 3, dtype=torch.bool, device="meta")).device.type == "meta"


def test_gae_reads_the_next_tokens_value_up_to_the_last_position():
    # γ = λ = 1, r = (0, 0, 1), V = (1, 2, 3): δ = (0 + 2 − 1, 0 + 3 − 2, 1 + 0 − 3) = (1, 1, −2),
    # advantages the reverse sums (0, −1, −2), returns A + V = (1, 1, 1)
    adv, ret = compute_gae_advantages(t([0.0, 0.0, 1.0]), t([1.0, 2.0, 3.0]), torch.ones(1, 3), 1.0, 1.0,
                                      whiten=False)
    assert adv.tolist() == [[0.0, -1.0, -2.0]] and ret.tolist() == [[1.0, 1.0, 1.0]]


def test_dynamic_sampling_limits():
    with pytest.raises(ValueError, match=r"^train_batch_size=0 must be a positive number of groups$"):
        InformativeGroupBuffer(0)
    with pytest.raises(ValueError, match=r"^max_num_gen_batches=-1 must be >= 0 \(0 = unlimited\)$"):
        InformativeGroupBuffer(1, -1)
    with pytest.raises(ValueError, match=r"^got 2 group ids but 3 metric values; need one per sample$"):
        informative_group_mask([0, 0], [1.0, 0.0, 1.0])
    buffer = InformativeGroupBuffer(1, max_num_gen_batches=1)  # one batch allowed, and it keeps nothing
    expected = ("dynamic sampling kept 0 of 1 generated groups after 1 generation batches, short of "
                "train_batch_size=1 groups: too many groups have a constant metric (all solved or all failed). "
                "Use easier data (harder if most groups are all solved) or a larger generation batch "
                "(data.gen_batch_size), or set algorithm.dynamic_sampling.max_num_gen_batches=0 to keep "
                "generating without limit.")
    with pytest.raises(DynamicSamplingError, match="^" + re.escape(expected) + "$"):
        buffer.add(["a", "b"], [0, 0], [1.0, 1.0])
    with pytest.raises(ValueError, match="^" + re.escape("take() needs 1 kept groups but only 0 are kept; "
                                                         "add() more generation batches until is_full") + "$"):
        InformativeGroupBuffer(1).take()


@pytest.mark.parametrize("call, message", [
    (lambda: agg_loss(t([1.0]), torch.ones(1, 1), "mean"),
     "unknown loss_agg_mode 'mean'; valid modes: token-mean, seq-mean-token-sum, seq-mean-token-mean, "
     "seq-mean-token-sum-norm"),
    (lambda: kl_penalty(t([0.0]), t([0.0]), "k4"),
     "unknown KL kind 'k4'; valid kinds: k1, kl, abs, k2, mse, k3, low_var_kl"),
    (lambda: loss_of(0.0, 1.0, ratio_level="seq"), "unknown ratio_level 'seq'; valid: token, sequence"),
    (lambda: loss_of(0.0, 1.0, tis_level="seq", tis_cap=2.0, rollout_log_prob=t([0.0])),
     "unknown tis_level 'seq'; valid: token, sequence"),
    (lambda: loss_of(0.0, 1.0, tis_cap=0.0, rollout_log_prob=t([0.0])),
     "tis_cap=0.0 must be > 0 (it caps the importance weights)"),
    (lambda: loss_of(0.0, 1.0, tis_cap=2.0),
     "tis_cap=2.0 turns on truncated importance sampling but rollout_log_prob is None; have the rollout "
     "engine return log-probs, or set algorithm.tis_cap=null"),
    (lambda: loss_of(0.0, 1.0, clip_ratio_c=1.0),
     "clip_ratio_c=1.0 must be > 1 (the dual-clip bound; DAPO/verl use 3.0)"),
    (lambda: value_loss(t([0.0]), t([0.0]), t([0.0]), torch.ones(1, 1), cliprange_value=0.0),
     "cliprange_value=0.0 must be > 0 (critic.cliprange_value)"),
    (lambda: overlong_penalty(5, 10, 0), "buffer_len=0 must be > 0 (algorithm.overlong.buffer_len)"),
    (lambda: overlong_penalty(5, 10, 10),
     "buffer_len=10 must be below max_response_length=10: the punishment zone is the last buffer_len tokens "
     "of the allowed length"),
])
def test_every_bad_setting_gets_its_own_message(call, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        call()


def test_settings_just_inside_the_limits_are_taken():
    loss_of(0.0, 1.0, clip_ratio_c=1.5)
    loss_of(0.0, 1.0, tis_cap=0.5, rollout_log_prob=t([0.0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.int64])
def test_group_statistics_of_half_or_integer_scores_are_taken_in_float32(dtype):
    # scores 1000 and 1001 in one group: mean 1000.5, std √0.5, A = ±0.5/√0.5 = ±√0.5
    adv = compute_grpo_advantages(torch.tensor([1000, 1001], dtype=dtype), [0, 0], eps=0.0)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([-math.sqrt(0.5), math.sqrt(0.5)]), rtol=0, atol=1e-6)


def test_group_ids_of_the_wrong_shape_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^group_ids must be one id per sample, shape \(B,\); got shape \(2, 1\)$"):
        group_index(torch.tensor([[0], [1]]))


def test_entropy_shifts_each_row_by_its_own_maximum():
    # two uniform rows of 4 tokens, far apart: each has entropy log 4. Shifted by the batch's
    # maximum, the second row's two terms would be near −1e5 and cancel to within float32's 0.01
    logits = torch.tensor([[1e5, 1e5, 1e5, 1e5], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.full((2,), math.log(4.0)), rtol=0, atol=1e-6)
