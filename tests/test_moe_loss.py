"""The mixture-of-experts load-balancing loss (megatron's aux_loss) and load metric, by hand."""

import math

import pytest
import torch

from megarl.backends.moe import load_balancing_loss, load_max_over_mean, routed_counts


def test_load_balancing_loss_by_hand():
    # router logits as log-probabilities: token 0 prefers expert 0, token 1 expert 1, token 2 is padding
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.0001, 0.0001, 0.9998]])
    logits = [probs.log()]
    real = torch.tensor([True, True, False])
    # T = 2 real tokens, top-1 counts n = [1, 1, 0], summed probabilities [0.6, 0.9, 0.5]:
    # 0.1 * 3 / (1 * 2^2) * (0.6 * 1 + 0.9 * 1 + 0.5 * 0) = 0.1125
    assert float(load_balancing_loss(logits, real, topk=1, coeff=0.1)) == pytest.approx(0.1125, rel=1e-6)
    # top-2: counts [1, 2, 1] -> 0.1 * 3 / (2 * 4) * (0.6 + 1.8 + 0.5) = 0.10875; two layers add up
    assert float(load_balancing_loss(logits * 2, real, topk=2, coeff=0.1)) == pytest.approx(2 * 0.10875, rel=1e-6)
    assert routed_counts(logits, real, 2).tolist() == [[1, 2, 1]]
    # balanced [1, 1, 0] -> max 1 over mean 2/3
    assert load_max_over_mean(routed_counts(logits, real, 1)) == pytest.approx(1.5)


def test_the_loss_has_a_gradient_through_the_probabilities_only():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]], requires_grad=True)
    load_balancing_loss([logits], torch.tensor([True, True]), topk=1, coeff=1.0).backward()
    # n = [1, 1], T = 2: loss = 2 / 4 * (p00 + p10 + p01 + p11) = 2 / 4 * 2 = 1 whatever the logits
    assert torch.allclose(logits.grad, torch.zeros(2, 2), atol=1e-7)
    assert math.isclose(float(load_balancing_loss([logits], torch.tensor([True, True]), 1, 1.0)), 1.0, rel_tol=1e-6)
