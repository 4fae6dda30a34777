"""Loss aggregation (megarl.algo.agg_loss) and the gradient-accumulation contract:
micro-batch and data-parallel splits with global counts give the full-batch gradient."""

import pytest
import torch

from megarl.algo import LOSS_AGG_MODES, agg_loss, policy_loss

NAN = float("nan")
# row 0: three valid tokens (1, 2, 3), row 1: two valid tokens (4, 5) and a NaN in padding
LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, NAN]]
MASK = [[1, 1, 1], [1, 1, 0]]


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, 15 / 5),
        ("token-mean", {"num_tokens": 10}, 15 / 10),
        ("seq-mean-token-sum", {}, (6 + 9) / 2),
        ("seq-mean-token-sum", {"num_seqs": 5}, (6 + 9) / 5),
        ("seq-mean-token-mean", {}, (6 / 3 + 9 / 2) / 2),
        ("seq-mean-token-mean", {"num_seqs": 4}, (6 / 3 + 9 / 2) / 4),
        ("seq-mean-token-sum-norm", {}, 15 / (2 * 3)),  # norm_length defaults to T = 3
        ("seq-mean-token-sum-norm", {"norm_length": 5}, 15 / (2 * 5)),
    ],
)
def test_agg_loss_modes(mode, kwargs, expected):
    result = agg_loss(torch.tensor(LOSS, dtype=torch.float64), torch.tensor(MASK), mode, **kwargs)
    torch.testing.assert_close(result, torch.tensor(expected, dtype=torch.float64))


def test_agg_loss_all_padding_is_zero():
    assert agg_loss(torch.ones(2, 3), torch.zeros(2, 3), "token-mean").item() == 0.0


def test_agg_loss_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        agg_loss(torch.ones(1, 1), torch.ones(1, 1), "sum")


# ---- gradient accumulation -------------------------------------------------------------

LENGTHS = [5, 1, 7, 3, 8, 2]  # uneven responses, so micro-batches see different token counts
MAX_LEN = 8


def _padded_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(len(LENGTHS), MAX_LEN, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1] * n + [0] * (MAX_LEN - n) for n in LENGTHS])
    return data, mask


def _micro_batch(rows, *tensors_and_mask):
    """Rows of the batch, padding trimmed to this micro-batch's longest response (as a
    dynamic-batching trainer would), so T differs between micro-batches."""
    *tensors, mask = tensors_and_mask
    width = int(mask[rows].sum(-1).max())
    return [t[rows, :width] for t in tensors] + [mask[rows, :width]]


def _grad(loss_fn, theta):
    theta.grad = None
    loss_fn().backward()
    return theta.grad.clone()


def _accumulated_grad(theta, per_micro_loss, ranks):
    """ranks: list (per DP rank) of lists of row indices per micro-batch. Each rank sums its
    micro-batch grads; the all-reduce AVERAGES over ranks (torch DDP), so losses are × dp."""
    dp = len(ranks)
    rank_grads = []
    for micro_batches in ranks:
        theta.grad = None
        for rows in micro_batches:
            (per_micro_loss(torch.tensor(rows)) * dp).backward()
        rank_grads.append(theta.grad.clone())
    return torch.stack(rank_grads).mean(0)


SPLITS = {
    "micro-batches": [[[0, 1], [2], [3, 4, 5]]],
    "dp2 x micro-batches": [[[0, 3], [5]], [[1], [2, 4]]],
}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_accumulated_gradient_equals_full_batch(mode, split):
    data, mask = _padded_batch(0)
    theta = torch.randn(MAX_LEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    global_counts = {"num_tokens": int(mask.sum()), "num_seqs": len(LENGTHS), "norm_length": MAX_LEN}

    def loss_of(x, m):
        width = x.shape[-1]
        return agg_loss(torch.sin(x * theta[:width]) + theta[:width] ** 2, m, mode, **global_counts)

    full = _grad(lambda: loss_of(data, mask), theta)
    accumulated = _accumulated_grad(theta, lambda rows: loss_of(*_micro_batch(rows, data, mask)), SPLITS[split])
    torch.testing.assert_close(accumulated, full, atol=1e-6, rtol=0)


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_accumulated_gradient_equals_full_batch(mode, split):
    data, mask = _padded_batch(2)
    gen = torch.Generator().manual_seed(3)
    old_log_prob = -torch.rand(data.shape, generator=gen, dtype=torch.float64)
    advantages = torch.randn(data.shape, generator=gen, dtype=torch.float64)
    # a shared parameter moves log-probs far enough that some tokens clip on either side
    theta = torch.full((MAX_LEN,), 0.3, dtype=torch.float64, requires_grad=True)
    global_counts = {"num_tokens": int(mask.sum()), "num_seqs": len(LENGTHS), "norm_length": MAX_LEN}

    def loss_of(x, old, adv, m):
        log_prob = old + x * theta[: x.shape[-1]]
        loss, _ = policy_loss(log_prob, old, adv, m, loss_agg_mode=mode, **global_counts)
        return loss

    full = _grad(lambda: loss_of(data, old_log_prob, advantages, mask), theta)
    assert full.abs().sum() > 0
    accumulated = _accumulated_grad(
        theta, lambda rows: loss_of(*_micro_batch(rows, data, old_log_prob, advantages, mask)), SPLITS[split]
    )
    torch.testing.assert_close(accumulated, full, atol=1e-6, rtol=0)
