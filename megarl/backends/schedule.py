"""The learning-rate schedule both backends follow: linear warm-up to lr over
lr_warmup_steps (the first step already at lr / warmup), then constant, or cosine down to
min_lr_ratio * lr at total_steps. Both count optimizer steps, not training steps: a training
step takes one per mini-batch per epoch (`optimizer_steps`)."""

from __future__ import annotations

import math

from megarl.config import OptimConfig, TrainWorkerConfig


def optimizer_steps(training_steps: int, train_batch_size: int, worker: TrainWorkerConfig) -> int:
    """The optimizer steps of a run of `training_steps` steps: each step's batch of train_batch_size
    prompt groups is cut into mini-batches of worker.ppo_mini_batch_size groups (the last one may
    be smaller), one optimizer step each, ppo_epochs times."""
    return training_steps * -(-train_batch_size // worker.ppo_mini_batch_size) * worker.ppo_epochs


def lr_factor(optim: OptimConfig, total_steps: int, step: int) -> float:
    """The multiplier of optim.lr for optimizer step `step` (0-based) of `total_steps` optimizer steps."""
    if optim.lr_warmup_steps and step < optim.lr_warmup_steps:
        return (step + 1) / optim.lr_warmup_steps
    if optim.lr_scheduler == "constant":
        return 1.0
    decay_steps = max(total_steps - optim.lr_warmup_steps, 1)
    progress = min((step - optim.lr_warmup_steps) / decay_steps, 1.0)
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
