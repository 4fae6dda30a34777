"""The learning-rate schedule both backends follow: linear warm-up to lr over
lr_warmup_steps (the first step already at lr / warmup), then constant, or cosine down to
min_lr_ratio * lr at total_steps."""

from __future__ import annotations

import math

from megarl.config import OptimConfig


def lr_factor(optim: OptimConfig, total_steps: int, step: int) -> float:
    """The multiplier of optim.lr for optimizer step `step` (0-based)."""
    if optim.lr_warmup_steps and step < optim.lr_warmup_steps:
        return (step + 1) / optim.lr_warmup_steps
    if optim.lr_scheduler == "constant":
        return 1.0
    decay_steps = max(total_steps - optim.lr_warmup_steps, 1)
    progress = min((step - optim.lr_warmup_steps) / decay_steps, 1.0)
    return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
