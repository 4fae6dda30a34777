"""One optimizer step over a mini-batch split into micro-batches (gradient accumulation).

Shared by the torch actor and critic. Each micro-batch's loss must already be normalised by
the mini-batch's global counts (megarl.algo.aggregation), so the accumulated gradient does
not depend on the split. A NaN/inf gradient norm skips the step (the weights stay as they
were) and is reported as skipped_steps = 1. Main entry point: `accumulate_and_step`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch

from megarl.backends.batch import TrainBatch

LossFn = Callable[[TrainBatch, dict], tuple[torch.Tensor, dict[str, float]]]


def check_split(mini_batch_samples: int, micro_batch_samples: int) -> None:
    if mini_batch_samples % micro_batch_samples:
        raise ValueError(f"micro batch of {micro_batch_samples} samples does not divide the mini batch of "
                         f"{mini_batch_samples}")


def accumulate_and_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LRScheduler, mini: TrainBatch, micro_size: int,
                        grad_clip: float, loss_fn: LossFn, norm_length: int | None = None) -> dict[str, float]:
    """loss_fn(micro_batch, counts) -> (loss, metrics), counts = {num_tokens, num_seqs,
    norm_length} of the whole mini-batch. Metrics are averaged with each micro-batch
    weighted by its share of the mini-batch's loss tokens."""
    counts = {"num_tokens": int(mini.loss_mask.sum()), "num_seqs": len(mini), "norm_length": norm_length}
    metrics: dict[str, float] = defaultdict(float)
    optimizer.zero_grad(set_to_none=True)
    for start in range(0, len(mini), micro_size):
        micro = mini.select(slice(start, start + micro_size))
        share = int(micro.loss_mask.sum()) / max(counts["num_tokens"], 1)
        loss, micro_metrics = loss_fn(micro, counts)
        loss.backward()
        for key, value in micro_metrics.items():
            metrics[key] += share * value
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    metrics["lr"] = scheduler.get_last_lr()[0]
    metrics["grad_norm"] = grad_norm
    if math.isfinite(grad_norm):
        optimizer.step()
        scheduler.step()
    else:
        optimizer.zero_grad(set_to_none=True)
        metrics["skipped_steps"] = 1.0
    return dict(metrics)
