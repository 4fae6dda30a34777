"""KL estimators (megarl.algo.kl_penalty)."""

import math

import pytest
import torch

from megarl.algo import kl_penalty

# d = logp − ref = [0.5, −1.0]
LOG_PROB = [[-1.0, -2.0]]
REF_LOG_PROB = [[-1.5, -1.0]]


@pytest.mark.parametrize(
    "kinds, expected",
    [
        (("k1", "kl"), [0.5, -1.0]),
        (("abs",), [0.5, 1.0]),
        (("k2", "mse"), [0.5 * 0.25, 0.5 * 1.0]),
        # e^{ref−logp} − (ref − logp) − 1
        (("k3", "low_var_kl"), [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]),
    ],
)
def test_kl_kinds(kinds, expected):
    for kind in kinds:
        result = kl_penalty(torch.tensor(LOG_PROB, dtype=torch.float64), torch.tensor(REF_LOG_PROB, dtype=torch.float64), kind)
        torch.testing.assert_close(result, torch.tensor([expected], dtype=torch.float64))


def test_k3_is_clamped_and_keeps_finite_gradients():
    # d = −30: e^{30} − 30 − 1 → 10;  d = +30: e^{−30} + 30 − 1 ≈ 29 → 10;  d = 0 → 0
    log_prob = torch.tensor([[-30.0, 30.0, 0.0]], requires_grad=True)
    result = kl_penalty(log_prob, torch.zeros(1, 3), "k3")
    torch.testing.assert_close(result, torch.tensor([[10.0, 10.0, 0.0]]))
    result.sum().backward()
    assert torch.isfinite(log_prob.grad).all()


def test_kl_gradients_by_hand():
    # d/dlogp of: k1 = 1, k2 = d, k3 = 1 − e^{−d}  at d = 0.5
    log_prob = torch.tensor([[0.5]], dtype=torch.float64, requires_grad=True)
    for kind, expected in [("k1", 1.0), ("k2", 0.5), ("k3", 1 - math.exp(-0.5)), ("abs", 1.0)]:
        log_prob.grad = None
        kl_penalty(log_prob, torch.zeros(1, 1, dtype=torch.float64), kind).sum().backward()
        assert log_prob.grad.item() == pytest.approx(expected), kind


def test_unknown_kl_kind_lists_valid_kinds():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
