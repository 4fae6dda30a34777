"""Torch critic: value alignment, start at zero, regression towards returns, split invariance."""

from __future__ import annotations

import copy

import torch

from megarl.backends.torch.critic import TorchCritic
from megarl.config import OptimConfig
from test_backend_torch_actor import random_batch
from tiny_models import tiny_model


def critic(model, micro=8, lr=1e-2):
    return TorchCritic(model, OptimConfig(lr=lr, lr_warmup_steps=0, weight_decay=0.0), cliprange_value=100.0,
                       mini_batch_samples=8, micro_batch_samples=micro)


def test_values_start_at_zero_and_read_the_previous_position():
    batch, _ = random_batch()
    c = critic(tiny_model("qwen2"))
    assert torch.equal(c.compute_values(batch), torch.zeros(batch.input_ids.shape))
    with torch.no_grad():
        c.model.value_head.bias.fill_(0.0)
        c.model.value_head.weight.normal_()
    values = c.compute_values(batch)
    hidden = c.model.backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    expected = hidden @ c.model.value_head.weight[0]
    torch.testing.assert_close(values[:, 1:], expected[:, :-1].detach(), atol=1e-5, rtol=0)
    assert (values[:, 0] == 0).all()


def test_regresses_towards_the_returns_and_split_does_not_matter():
    batch, g = random_batch(seed=5)
    base = tiny_model("qwen2")
    returns = torch.where(batch.loss_mask.bool(), torch.full(batch.input_ids.shape, 0.7), torch.zeros(()))
    states = []
    for micro in (8, 2):
        c = critic(copy.deepcopy(base), micro=micro)
        batch_v = batch.with_fields(values=c.compute_values(batch), returns=returns)
        first = c.update_critic(batch_v)["vf_loss"]
        for _ in range(30):
            last = c.update_critic(batch.with_fields(values=c.compute_values(batch), returns=returns))["vf_loss"]
        states.append(c.model.state_dict())
        # ½(0 − 0.7)² = 0.245 at the start (values are 0); the fit must get far below that
        assert abs(first - 0.245) < 1e-6 and last < 0.02
    for name, tensor in states[0].items():
        torch.testing.assert_close(states[1][name], tensor, atol=1e-4, rtol=0)
