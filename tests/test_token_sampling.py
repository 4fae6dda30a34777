"""The embedded engine's sampler draws from the distribution its log-probs state: frequencies
over many rows against probabilities worked out by hand (temperature, top-k, top-p), tokens of
probability 0 never drawn, a seeded row independent of its batch."""

import math

import pytest
import torch

from megarl.rollout.engine import SamplingParams
from megarl.rollout.token_sampling import sample_next_tokens

PROBS = [0.1, 0.2, 0.3, 0.4, 0.0]  # the last token can never be drawn
ROWS = 4000  # a frequency's standard deviation is at most 0.008; the tolerance is 4 of them


def draw(probs, params):
    logits = torch.tensor([math.log(p) if p > 0 else -math.inf for p in probs]).repeat(ROWS, 1)
    generators = [torch.Generator().manual_seed(i) for i in range(ROWS)]
    tokens, log_probs = sample_next_tokens(logits, [params] * ROWS, generators)
    return tokens, log_probs, logits


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1.0), PROBS),
    # T = 2: p^(1/2) renormalised; sqrt(.1), sqrt(.2), sqrt(.3), sqrt(.4) sum to 1.94362
    (SamplingParams(temperature=2.0), [0.1627, 0.2301, 0.2818, 0.3254, 0.0]),
    (SamplingParams(temperature=1.0, top_k=2), [0.0, 0.0, 3 / 7, 4 / 7, 0.0]),
    # top_p 0.75: 0.4, 0.3 and 0.2 (0.7 before it is under 0.75), not 0.1 (0.9 before it)
    (SamplingParams(temperature=1.0, top_p=0.75), [0.0, 2 / 9, 3 / 9, 4 / 9, 0.0]),
])
def test_frequencies_follow_the_truncated_distribution(params, expected):
    tokens, log_probs, logits = draw(PROBS, params)
    frequencies = torch.bincount(tokens, minlength=len(PROBS)).double() / ROWS
    assert frequencies.tolist() == pytest.approx(expected, abs=0.032)
    assert frequencies[4] == 0  # probability 0 is never drawn
    # the log-prob is of the tempered distribution before truncation
    tempered = torch.log_softmax(logits[0] / params.temperature, dim=-1)
    assert torch.allclose(log_probs, tempered[tokens])


def test_greedy_rows_take_the_most_likely_token_with_its_untempered_log_prob():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    tokens, log_probs = sample_next_tokens(logits, params, [torch.Generator(), torch.Generator()])
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(log_probs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0)] * 6
    alone = [sample_next_tokens(logits[i:i + 1], params[:1], [torch.Generator().manual_seed(10 + i)])[0].item()
             for i in range(6)]
    together = sample_next_tokens(logits, params, [torch.Generator().manual_seed(10 + i) for i in range(6)])[0]
    assert together.tolist() == alone
