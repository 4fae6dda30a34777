"""Masked statistics and prompt-group indexing (megarl.algo.masked, megarl.algo.groups)."""

import math

import pytest
import torch

from megarl.algo import masked_mean, masked_whiten
from megarl.algo.groups import group_index, group_mean_std

NAN = float("nan")


@pytest.mark.parametrize(
    "ids, expected_index, expected_groups",
    [
        # groups numbered by first appearance, not by id value
        (torch.tensor([7, 3, 7, 5, 3]), [0, 1, 0, 2, 1], 3),
        (["x", "y", "x", "z"], [0, 1, 0, 2], 3),
        ([("p", 1), ("p", 0), ("p", 1)], [0, 1, 0], 2),
        (torch.tensor([4]), [0], 1),
    ],
)
def test_group_index_numbers_groups_by_first_appearance(ids, expected_index, expected_groups):
    index, num_groups = group_index(ids)
    assert index.tolist() == expected_index
    assert num_groups == expected_groups


def test_group_mean_std_uneven_interleaved():
    # group 0: [1, 0, 3] → mean 4/3, sample var ((1/3)² + (4/3)² + (5/3)²)/2 = 7/3
    # group 1: [2, 5]    → mean 3.5, sample var (1.5² + 1.5²)/1 = 4.5;  group 2: [4] → std 0
    values = torch.tensor([1.0, 2.0, 0.0, 4.0, 3.0, 5.0], dtype=torch.float64)
    index = torch.tensor([0, 1, 0, 2, 0, 1])
    mean, std = group_mean_std(values, index, 3)
    torch.testing.assert_close(mean, torch.tensor([4 / 3, 3.5, 4 / 3, 4.0, 4 / 3, 3.5], dtype=torch.float64))
    s0, s1 = math.sqrt(7 / 3), math.sqrt(4.5)
    torch.testing.assert_close(std, torch.tensor([s0, s1, s0, 0.0, s0, s1], dtype=torch.float64))


@pytest.mark.parametrize(
    "values, mask, dim, expected",
    [
        # (1 + 2 + 3) / 3; NaN in padding must not leak
        ([[1.0, 2.0, NAN], [3.0, NAN, NAN]], [[1, 1, 0], [1, 0, 0]], None, 2.0),
        ([[1.0, 2.0, NAN], [3.0, NAN, NAN]], [[1, 1, 0], [1, 0, 0]], -1, [1.5, 3.0]),
        # empty mask gives 0, not NaN
        ([[5.0, 6.0]], [[0, 0]], None, 0.0),
    ],
)
def test_masked_mean(values, mask, dim, expected):
    result = masked_mean(torch.tensor(values), torch.tensor(mask), dim=dim)
    torch.testing.assert_close(result, torch.tensor(expected))


def test_masked_whiten_uses_unbiased_variance_over_the_batch():
    # valid values 1, 2, 3: mean 2, unbiased var (1 + 0 + 1)/2 = 1 → (x − 2)/sqrt(1 + eps)
    values = torch.tensor([[1.0, 2.0, NAN], [3.0, 100.0, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    eps = 1e-8
    expected = torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64) / math.sqrt(1 + eps)
    torch.testing.assert_close(masked_whiten(values, mask, eps=eps), expected)
