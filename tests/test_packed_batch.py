"""The packed batch the driver holds and sends: its rows against TrainBatch's own padding, row
selection, and each data-parallel rank's share worked out by hand."""

import pickle

import pytest
import torch

from megarl.backends.batch import TrainBatch
from megarl.backends.packed import DataShare, PackedBatch, forward_shares, update_shares

PROMPTS = [[5, 6], [7], [8, 9, 10], [11], [12, 13], [14]]
RESPONSES = [[20, 21, 22], [23], [24, 25], [26, 27, 28, 29], [30], [31, 32]]
MASKS = [[1, 0, 1], [1], [1, 1], [1, 1, 0, 1], [1], [0, 1]]
LOG_PROBS = [[-0.1 * (i + 1)] * len(r) for i, r in enumerate(RESPONSES)]


def routed(rows):
    """Each row's routing (positions but the last, width 2), the row's own values."""
    return [torch.arange(2 * (len(PROMPTS[i]) + len(RESPONSES[i]) - 1), dtype=torch.int16).reshape(-1, 2) + 100 * i
            for i in rows]


def packed(rows=None):
    rows = rows if rows is not None else range(len(PROMPTS))
    pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
    return PackedBatch.from_sequences(pick(PROMPTS), pick(RESPONSES), pick(MASKS), pick(LOG_PROBS), routed(rows))


def assert_rows_equal(got: TrainBatch, want: TrainBatch):
    for name in ("input_ids", "attention_mask", "loss_mask", "rollout_log_probs"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), msg=name)
    torch.testing.assert_close(got.routing(), want.routing())


def test_padded_rows_are_trainbatchs_own():
    batch = packed()
    assert batch.lengths.tolist() == [5, 2, 5, 5, 3, 3] and batch.num_tokens == 23
    assert batch.input_ids.dtype == torch.int32 and batch.loss_mask.dtype == torch.bool
    want = TrainBatch.from_sequences(PROMPTS, RESPONSES, MASKS, rollout_log_probs=LOG_PROBS,
                                     routed_experts=routed(range(6)))
    assert_rows_equal(batch.padded(), want)
    torch.testing.assert_close(batch.pack(want.rollout_log_probs), batch.rollout_log_probs)
    again = PackedBatch.from_rows(want)
    assert again.lengths.tolist() == batch.lengths.tolist()
    assert torch.equal(again.input_ids, batch.input_ids)
    assert all(torch.equal(a, b) for a, b in zip(again.routed_experts.rows, batch.routed_experts.rows, strict=True))


def test_the_routing_is_the_engines_own_tensors_moved_not_copied():
    # the routing is most of a token's bytes: building and selecting rows move the engine's
    # tensors; only a share sent copies them
    engines = routed(range(6))
    batch = PackedBatch.from_sequences(PROMPTS, RESPONSES, MASKS, LOG_PROBS, engines)
    assert all(got is want for got, want in zip(batch.routed_experts.rows, engines, strict=True))
    batch = batch.select(torch.tensor([5, 3, 1, 0, 2, 4]))
    assert all(got is engines[i] for got, i in zip(batch.routed_experts.rows, [5, 3, 1, 0, 2, 4], strict=True))
    share = update_shares(batch, 2, 4)[1]  # rows 1, 0 of the first mini-batch, 4 of the second
    assert share.rows == (slice(2, 4), slice(5, 6))
    assert all(got is engines[i] for got, i in zip(share.batch.routed_experts.rows, [1, 0, 4], strict=True))
    back = pickle.loads(pickle.dumps(share))
    assert [r.tolist() for r in back.batch.routed_experts.rows] == [engines[i].tolist() for i in [1, 0, 4]]


@pytest.mark.parametrize("index", [[3, 0, 5, 1], slice(1, 4), slice(0, 6, 2), [2]])
def test_selected_rows_are_those_rows_built_alone(index):
    rows = list(range(6))[index] if isinstance(index, slice) else index
    assert_rows_equal(packed().select(index if isinstance(index, slice) else torch.tensor(index)).padded(),
                      packed(rows).padded())


def test_only_the_fields_named_travel():
    batch = packed().with_fields(advantages=torch.ones(23), returns=torch.ones(23))
    kept = batch.only("advantages")
    assert kept.advantages is not None and kept.returns is None and kept.rollout_log_probs is None
    assert kept.input_ids is batch.input_ids and kept.routed_experts is batch.routed_experts


def test_update_shares_by_hand():
    """6 rows, mini-batches of 4, 2 DP ranks: mini-batch 1 is rows 0-3 (rank 0: 0, 1; rank 1: 2, 3),
    mini-batch 2 rows 4-5 (rank 0: 4; rank 1: 5). Loss tokens: rows 0-3 hold 2 + 1 + 2 + 3 = 8,
    rows 4-5 hold 1 + 1 = 2."""
    batch = packed()
    shares = update_shares(batch, 2, 4)
    assert [s.dp_rank for s in shares] == [0, 1]
    assert shares[0].minis == ((2, 8, 4), (1, 2, 2)) and shares[1].minis == ((2, 8, 4), (1, 2, 2))
    assert_rows_equal(shares[0].batch.padded(), packed([0, 1, 4]).padded())
    assert_rows_equal(shares[1].batch.padded(), packed([2, 3, 5]).padded())
    minis = list(shares[1].mini_batches())
    assert_rows_equal(minis[0][0].padded(), packed([2, 3]).padded())
    assert minis[1][1] == {"num_tokens": 2, "num_seqs": 2}


def test_forward_shares_are_consecutive_rows_in_rank_order():
    shares = forward_shares(packed(), 4)  # 6 rows over 4: bounds 0, 1, 3, 4, 6
    assert [len(s.batch) for s in shares] == [1, 2, 1, 2] and all(s.minis == () for s in shares)
    assert_rows_equal(shares[1].batch.padded(), packed([1, 2]).padded())


def test_a_share_is_pickled_with_its_own_rows_only():
    """A slice of consecutive rows views the batch's storage; a torch tensor view is pickled with
    all of it, a packed batch with its own rows only, and comes back equal."""
    big = PackedBatch.from_sequences([[1]] * 1000, [[2] * 99] * 1000, [[1] * 99] * 1000, [[-1.0] * 99] * 1000)
    share = forward_shares(big, 100)[0]
    assert isinstance(share, DataShare) and len(share.batch) == 10
    assert share.batch.input_ids.untyped_storage().nbytes() == big.input_ids.untyped_storage().nbytes()  # a view
    assert len(pickle.dumps(share.batch.input_ids)) > 4 * 100 * 1000  # as a tensor: the whole storage
    assert len(pickle.dumps(share)) < 2 * share.batch.nbytes() + 4096
    back = pickle.loads(pickle.dumps(share))
    assert_rows_equal(back.batch.padded(), share.batch.padded())


def test_a_share_of_no_rows_packs_to_no_tokens():
    # DP 4 over a batch of 2 rows (the weights probe at DP 8 or 32): ranks 0 and 2 get no row
    batch = PackedBatch.from_sequences([[1, 2], [3]], [[4], [5, 6]], [[1], [1, 1]])
    shares = forward_shares(batch, 4)
    assert [len(s.batch) for s in shares] == [0, 1, 0, 1]
    empty = shares[0].batch
    padded = empty.padded()
    assert padded.input_ids.shape == (0, 0)
    assert empty.pack(torch.zeros(0, 0)).shape == (0,)
    assert empty.pack(torch.zeros(0, 3, 2)).shape == (0, 2)  # trailing dimensions kept
