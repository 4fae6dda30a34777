"""DAPO soft overlong punishment (megarl.algo.overlong_penalty)."""

import pytest
import torch

from megarl.algo import overlong_penalty

# L_max = 20, buffer = 4: the zone starts at 16; penalty = min(−(L − 16)/4 × factor, 0)
CASES = [
    (10, 1.0, 0.0),
    (16, 1.0, 0.0),
    (17, 1.0, -0.25),
    (20, 1.0, -1.0),
    (18, 0.5, -0.25),  # −(2/4) × 0.5
    (19.0, 2.0, -1.5),  # −(3/4) × 2
]


@pytest.mark.parametrize("length, factor, expected", CASES)
def test_overlong_penalty_on_numbers(length, factor, expected):
    result = overlong_penalty(length, max_response_length=20, buffer_len=4, penalty_factor=factor)
    assert isinstance(result, float)
    assert result == pytest.approx(expected)


def test_overlong_penalty_on_tensors_is_elementwise():
    lengths = torch.tensor([case[0] for case in CASES if case[1] == 1.0])  # integer tensor
    expected = torch.tensor([case[2] for case in CASES if case[1] == 1.0])
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4), expected)


def test_dapo_setting():
    # L_max 20480, buffer 4096: zone from 16384; 18432 is half-way → −0.5
    assert overlong_penalty(18432, 20480, 4096) == pytest.approx(-0.5)


@pytest.mark.parametrize("buffer_len", [0, -1, 20, 25])
def test_overlong_penalty_validates_the_buffer(buffer_len):
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(10, max_response_length=20, buffer_len=buffer_len)
