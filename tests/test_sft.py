"""Supervised warm-up: the loss is the masked token-mean NLL, and it teaches a response."""

from dataclasses import dataclass

import pytest
import torch

from megarl.config import OptimConfig
from megarl.quickstart.sft import supervised_warmup
from tiny_models import reference_log_probs, tiny_model


@dataclass
class Ex:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]


EXAMPLES = [Ex([5, 6, 7], [20, 21, 22, 23], [1, 0, 0, 1]), Ex([8, 9], [30, 31, 32], [1, 1, 1])]


def test_first_loss_is_the_masked_token_mean_nll():
    model = tiny_model("qwen2", vocab_size=64)
    by_hand = []
    for ex in EXAMPLES:
        lp = reference_log_probs(model, ex.prompt_ids, ex.response_ids)
        by_hand += [-float(x) for x, keep in zip(lp, ex.loss_mask) if keep]
    losses = supervised_warmup(model, EXAMPLES, steps=1, batch_size=2, optim=OptimConfig(lr=1e-3), seed=0)
    assert losses[0] == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-5)


def test_warm_up_teaches_the_response():
    model = tiny_model("qwen2", vocab_size=64)
    optim = OptimConfig(lr=1e-2, lr_warmup_steps=5, weight_decay=0.0)
    losses = supervised_warmup(model, EXAMPLES, steps=60, batch_size=1, optim=optim, seed=0)
    assert losses[-1] < 0.05 < losses[0]
    ids = torch.tensor([[8, 9]])
    with torch.no_grad():
        for _ in range(3):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert ids[0, 2:].tolist() == [30, 31, 32]


def test_bad_input_is_refused():
    model = tiny_model("qwen2", vocab_size=64)
    with pytest.raises(ValueError, match="at least one example"):
        supervised_warmup(model, [], steps=1, batch_size=1, optim=OptimConfig(), seed=0)
    with pytest.raises(ValueError, match="must be positive"):
        supervised_warmup(model, EXAMPLES, steps=0, batch_size=1, optim=OptimConfig(), seed=0)
    with pytest.raises(ValueError, match="mask of 2"):
        supervised_warmup(model, [Ex([1], [2, 3, 4], [1, 1])], steps=1, batch_size=1, optim=OptimConfig(), seed=0)
