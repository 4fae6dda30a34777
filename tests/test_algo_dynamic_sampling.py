"""DAPO dynamic sampling (megarl.algo.dynamic_sampling)."""

import pytest
import torch

from megarl.algo import DynamicSamplingError, InformativeGroupBuffer, informative_group_mask


@pytest.mark.parametrize(
    "group_ids, metric, expected",
    [
        # a: [1, 0] varies → keep; b: [0, 0] constant → drop; c: alone → keep; d: [1, 1] → drop
        (["a", "b", "a", "c", "b", "d", "d"], [1, 0, 0, 1, 0, 1, 1], [1, 0, 1, 1, 0, 0, 0]),
        (torch.tensor([5, 5, 2, 2, 2]), [0.5, 0.5, 0.0, 0.0, 0.1], [0, 0, 1, 1, 1]),
        ([0, 0, 0], [1.0, 1.0, 1.0], [0, 0, 0]),
    ],
)
def test_informative_group_mask(group_ids, metric, expected):
    assert informative_group_mask(group_ids, metric).tolist() == [bool(x) for x in expected]


def test_buffer_accumulates_over_batches_keeps_groups_together_and_trims():
    buffer = InformativeGroupBuffer(train_batch_size=3, max_num_gen_batches=0)
    # batch 1: a informative (1, 0), b constant, c constant → one group kept
    buffer.add(["a0", "b0", "a1", "b1", "c0", "c1"], ["a", "b", "a", "b", "c", "c"], [1, 1, 0, 1, 0, 0])
    assert (buffer.num_kept_groups, buffer.num_gen_batches, buffer.is_full) == (1, 1, False)
    # batch 2, interleaved: d and f informative, e constant → 3 groups, full
    buffer.add(["d0", "e0", "f0", "d1", "e1", "f1"], ["d", "e", "f", "d", "e", "f"], [0, 1, 1, 1, 1, 0])
    assert (buffer.num_kept_groups, buffer.is_full) == (3, True)
    # batch 3 adds an extra group that take() trims
    buffer.add(["g0", "g1"], ["g", "g"], [0.0, 1.0])
    assert buffer.num_kept_groups == 4
    assert buffer.take() == ["a0", "a1", "d0", "d1", "f0", "f1"]
    assert (buffer.num_kept_groups, buffer.num_gen_batches, buffer.is_full) == (0, 0, False)


def test_buffer_treats_a_uid_reused_in_a_later_batch_as_a_new_group():
    buffer = InformativeGroupBuffer(train_batch_size=2)
    buffer.add([{"id": 0}, {"id": 1}], ["u", "u"], [0, 1])
    buffer.add([{"id": 2}, {"id": 3}], ["u", "u"], [1, 0])
    assert buffer.take() == [{"id": 0}, {"id": 1}, {"id": 2}, {"id": 3}]


def test_buffer_accepts_tensor_group_ids_and_metric():
    buffer = InformativeGroupBuffer(train_batch_size=1)
    buffer.add(["x", "y", "z"], torch.tensor([3, 3, 4]), torch.tensor([0.0, 1.0, 1.0]))
    assert buffer.take() == ["x", "y"]


def test_buffer_raises_when_the_generation_budget_runs_out():
    buffer = InformativeGroupBuffer(train_batch_size=2, max_num_gen_batches=2)
    buffer.add(["a0", "a1", "b0", "b1"], ["a", "a", "b", "b"], [1, 1, 0, 0])  # nothing kept, 1 of 2 batches
    with pytest.raises(DynamicSamplingError) as error:
        buffer.add(["c0", "c1", "d0", "d1"], ["c", "c", "d", "d"], [0, 1, 0, 0])  # one kept, budget spent
    message = str(error.value)
    assert "kept 1 of 4 generated groups after 2 generation batches" in message
    assert "larger generation batch" in message and "easier data" in message
    assert "algorithm.dynamic_sampling.max_num_gen_batches=0" in message


def test_buffer_filling_on_the_last_allowed_batch_does_not_raise():
    buffer = InformativeGroupBuffer(train_batch_size=1, max_num_gen_batches=2)
    buffer.add(["a0", "a1"], ["a", "a"], [0, 0])
    buffer.add(["b0", "b1"], ["b", "b"], [0, 1])
    assert buffer.take() == ["b0", "b1"]


def test_unlimited_buffer_never_raises():
    buffer = InformativeGroupBuffer(train_batch_size=1, max_num_gen_batches=0)
    for _ in range(50):
        buffer.add(["s0", "s1"], ["g", "g"], [1, 1])
    assert (buffer.num_gen_batches, buffer.num_kept_groups) == (50, 0)


def test_take_before_full_and_mismatched_lengths_are_errors():
    buffer = InformativeGroupBuffer(train_batch_size=2)
    with pytest.raises(ValueError, match="is_full"):
        buffer.take()
    with pytest.raises(ValueError, match="one entry per sample"):
        buffer.add(["s0", "s1"], ["g"], [0, 1])
