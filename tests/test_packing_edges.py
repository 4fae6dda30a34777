"""The edges of the packed batch and the update's epochs that mutation testing (`make mutants`)
found unchecked: a rank's third mini-batch, rows packed back from a worker's padding, the pad
id, an empty batch, the bytes a batch holds, arrays Ray hands over read-only, and the epochs'
walk over the mini-batches. Expected values are worked out by hand."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch

from megarl.backends.epochs import mean_metrics, run_epochs, shuffled, update_permutation
from megarl.backends.batch import TrainBatch
from megarl.backends.packed import DataShare, PackedBatch, as_rows, forward_shares, read_only_rows, update_shares
from test_packed_batch import packed


def test_a_share_walks_all_its_mini_batches():
    share = DataShare(packed(), 0, 1, minis=((2, 5, 2), (1, 1, 1), (3, 7, 3)))
    got = [(m.lengths.tolist(), counts) for m, counts in share.mini_batches()]
    assert got == [([5, 2], {"num_tokens": 5, "num_seqs": 2}), ([5], {"num_tokens": 1, "num_seqs": 1}),
                   ([5, 3, 3], {"num_tokens": 7, "num_seqs": 3})]


def test_rows_packed_back_from_a_workers_padding_are_the_rows():
    batch = packed()
    back = PackedBatch.from_rows(batch.padded())
    assert back.lengths.tolist() == batch.lengths.tolist()
    assert back.input_ids.dtype == torch.int32 and torch.equal(back.input_ids, batch.input_ids)
    assert back.loss_mask.dtype == torch.bool and torch.equal(back.loss_mask, batch.loss_mask)
    assert torch.equal(back.rollout_log_probs, batch.rollout_log_probs)


def test_padding_takes_the_pad_id_and_an_empty_batch_pads_to_nothing():
    two = packed([0, 1]).padded(pad_id=99)  # rows of 5 and 2 tokens
    assert two.input_ids.tolist() == [[5, 6, 20, 21, 22], [7, 23, 99, 99, 99]]
    empty = PackedBatch.from_sequences([], [], []).padded()
    assert empty.input_ids.shape == (0, 0)


def test_a_batch_counts_the_bytes_of_its_routing_rows_too():
    batch = packed([0, 1])  # 7 tokens: ids int32, mask bool, rollout log-probs float32; lengths int64
    routing = (4 + 1) * 2 * 2  # rows of 4 and 1 positions, width 2, int16
    assert batch.nbytes() == 2 * 8 + 7 * 4 + 7 * 1 + 7 * 4 + routing


def test_arrays_handed_over_read_only_are_copied_and_writable_ones_are_not():
    state = pickle.loads(pickle.dumps(packed([0, 1]))).__getstate__()
    locked = state["input_ids"].copy()
    locked.flags.writeable = False
    state["input_ids"] = locked
    batch = PackedBatch.__new__(PackedBatch)
    batch.__setstate__(dict(state))
    batch.input_ids[0] = 99  # a copy: Ray's read-only store is not written
    assert locked[0] == 5
    assert np.shares_memory(batch.lengths.numpy(), state["lengths"])  # a writable array is taken as it is


def test_read_only_routing_rows_are_taken_without_a_warning():
    locked = np.zeros((3, 2), dtype=np.int16)
    locked.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = read_only_rows([locked])
    assert rows.rows[0].shape == (3, 2)


class Rows:
    """A batch of numbered rows that records which rows each optimizer step got."""

    def __init__(self, ids):
        self.ids = list(ids)

    def __len__(self):
        return len(self.ids)

    def select(self, index):
        if isinstance(index, slice):
            return Rows(self.ids[index])
        return Rows([self.ids[i] for i in index.tolist()])


def test_epochs_walk_every_mini_batch_in_order_and_average_the_steps():
    seen = []

    def step(mini):
        seen.append(mini.ids)
        return {"loss": float(len(seen)), "rows": float(len(mini))}

    metrics = run_epochs(Rows(range(5)), 2, 2, step)
    assert seen == [[0, 1], [2, 3], [4], [0, 1], [2, 3], [4]]
    assert metrics == {"loss": 3.5, "rows": 10 / 6}


def test_mean_metrics_averages_each_key_over_all_steps():
    assert mean_metrics([{"a": 1.0, "b": 2.0}, {"a": 3.0}]) == {"a": 2.0, "b": 1.0}
    assert mean_metrics([]) == {}


def test_the_update_order_is_a_permutation_drawn_from_seed_and_step_alone():
    orders = {(seed, step): update_permutation(8, seed, step).tolist() for seed in (1, 2) for step in (3, 4)}
    assert all(sorted(order) == list(range(8)) for order in orders.values())
    assert len({tuple(order) for order in orders.values()}) == 4  # each (seed, step) its own
    assert update_permutation(8, 1, 3).tolist() == orders[(1, 3)]
    batch = shuffled(Rows(range(8)), 1, 3)
    assert batch.ids == orders[(1, 3)]


def test_the_mean_of_one_step_is_that_step():
    assert mean_metrics([{"a": 4.0}]) == {"a": 4.0}


def test_a_rank_with_nothing_in_a_mini_batch_gets_only_its_own_tokens():
    # 6 rows, 2 ranks, mini-batches of 5 rows: the first gives each rank 2 rows (row 4 left out),
    # the second (row 5 alone) gives each none
    batch = packed()
    shares = update_shares(batch, 2, 5)
    assert [s.batch.lengths.tolist() for s in shares] == [[5, 2], [5, 5]]
    assert [(s.dp_rank, s.dp_size) for s in shares] == [(0, 2), (1, 2)]
    # (this rank's rows, the mini-batch's loss tokens, its rows): 2+1+2+3+1 tokens in rows 0-4, 1 in row 5
    assert [s.minis for s in shares] == [((2, 9, 5), (0, 1, 1))] * 2
    assert [s.rows for s in shares] == [(slice(0, 2), slice(5, 5)), (slice(2, 4), slice(5, 5))]
    ids = batch.input_ids.tolist()
    assert shares[0].batch.input_ids.tolist() == ids[0:7] and shares[1].batch.input_ids.tolist() == ids[7:17]


def test_forward_shares_name_their_rank_and_rows():
    shares = forward_shares(packed(), 2)
    assert [(s.dp_rank, s.dp_size, s.rows, s.minis) for s in shares] == [(0, 2, (slice(0, 3),), ()),
                                                                         (1, 2, (slice(3, 6),), ())]
    assert [s.batch.lengths.tolist() for s in shares] == [[5, 2, 5], [5, 3, 3]]


def test_an_empty_batch_has_typed_empty_fields_and_empty_shares():
    empty = PackedBatch.from_sequences([], [], [])
    assert (empty.input_ids.dtype, empty.loss_mask.dtype, empty.input_ids.numel()) == (torch.int32, torch.bool, 0)
    shares = update_shares(empty, 2, 4)
    assert [(len(s.batch), s.minis) for s in shares] == [(0, ()), (0, ())]


def test_selecting_no_rows_gives_an_empty_batch():
    batch = packed()
    for none in (slice(2, 2), []):
        picked = batch.select(none)
        assert len(picked) == 0 and picked.input_ids.numel() == 0 and picked.rollout_log_probs.numel() == 0
    assert batch.select(slice(0, 6, 2)).lengths.tolist() == [5, 5, 3]


def test_a_worker_computes_on_a_shares_rows_and_a_plain_batch_as_it_is():
    share = forward_shares(packed(), 2)[1]
    rows, back = as_rows(share)
    assert rows.input_ids.shape == (3, 5)
    assert torch.equal(back(rows.input_ids).to(torch.int32), share.batch.input_ids)
    plain = TrainBatch.from_sequences([[1]], [[2]], [[1]])
    rows, back = as_rows(plain)
    marker = torch.ones(1, 2)
    assert rows is plain and back(marker) is marker


def test_bad_rows_and_fields_are_named():
    with pytest.raises(ValueError, match=r"^2 prompts, 1 responses, 1 masks$"):
        PackedBatch.from_sequences([[1], [2]], [[3]], [[1]])
    with pytest.raises(ValueError, match=r"^row 0: response of 1 tokens but a mask of 2$"):
        PackedBatch.from_sequences([[1]], [[3]], [[1, 1]])
    with pytest.raises(ValueError, match=r"^row 0: empty prompt \(the first response token needs a context\)$"):
        PackedBatch.from_sequences([[]], [[3]], [[1]])
    with pytest.raises(KeyError, match=r"unknown PackedBatch fields \['logits'\]; valid: \("):
        packed().with_fields(logits=torch.zeros(23))


def test_a_rank_without_rows_gets_no_tokens():
    # mini-batches of 3 rows over 4 ranks: no rank gets a row (the rows past a multiple of 4 are left out)
    shares = update_shares(packed(), 4, 3)
    assert [(len(s.batch), s.batch.input_ids.numel()) for s in shares] == [(0, 0)] * 4
