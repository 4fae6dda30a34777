"""Supervised warm-up: teach a model a response format from token demonstrations.

The loss is the token-mean negative log-likelihood of the response tokens under their loss
mask (observation tokens, mask 0, are context only), the same layout the RL trainer sees.
It trains with AdamW and the trainer's warm-up / cosine schedule (`build_optimizer`). The
CPU quickstart warms its tiny model up with it before RL. Main entry point: `supervised_warmup`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

import torch
from tqdm import tqdm

from megarl.backends.batch import TrainBatch
from megarl.backends.torch.actor import build_optimizer
from megarl.backends.torch.logprobs import token_log_probs
from megarl.config import OptimConfig


class Example(Protocol):
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]


def supervised_warmup(model: torch.nn.Module, examples: Sequence[Example], *, steps: int, batch_size: int,
                      optim: OptimConfig, seed: int, pad_id: int = 0, desc: str = "warm-up") -> list[float]:
    """`steps` optimizer steps on batches drawn without replacement (reshuffled every epoch);
    returns the loss of every step. Raises ValueError on empty input or a non-finite loss."""
    if not examples:
        raise ValueError("supervised_warmup needs at least one example")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be positive, got {steps} and {batch_size}")
    rng = random.Random(seed)
    optimizer, scheduler = build_optimizer(model, optim, steps)
    device = next(model.parameters()).device
    order: list[int] = []
    losses = []
    model.train()
    progress = tqdm(range(steps), desc=desc, unit="step", mininterval=2.0)
    for step in progress:
        if len(order) < batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        picked = [examples[i] for i in order[:batch_size]]
        del order[:batch_size]
        batch = TrainBatch.from_sequences([e.prompt_ids for e in picked], [e.response_ids for e in picked],
                                          [e.loss_mask for e in picked], pad_id=pad_id)
        mask = batch.loss_mask.to(device).float()
        log_probs, _ = token_log_probs(model, batch.input_ids.to(device), batch.attention_mask.to(device))
        loss = -(log_probs * mask).sum() / mask.sum().clamp(min=1.0)
        if not torch.isfinite(loss):
            raise ValueError(f"{desc}: the loss became {float(loss)} at step {step}; lower the learning rate")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        progress.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
    model.eval()
    return losses
