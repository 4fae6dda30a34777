"""PPO epochs over mini-batches, shared by the torch and megatron backends.

An update walks its batch `epochs` times in order, in mini-batches of `mini_size` samples,
and takes one optimizer step per mini-batch; how a step is taken is the backend's. The
metrics of the update are the mean over its steps. Main entry point: `run_epochs`; the
driver first puts the batch in a seeded random order (`shuffled`), so that a mini-batch
mixes the prompts of the step rather than holding a few prompts' whole groups.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from megarl.backends.batch import TrainBatch


def run_epochs(batch: TrainBatch, mini_size: int, epochs: int, step: Callable[[TrainBatch], dict]) -> dict[str, float]:
    """`step` on every mini-batch of every epoch; the metrics averaged over the steps."""
    return mean_metrics(step(batch.select(slice(start, start + mini_size)))
                        for _ in range(epochs) for start in range(0, len(batch), mini_size))


def mean_metrics(steps: Iterable[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the steps (taken as they are iterated)."""
    sums: dict[str, float] = defaultdict(float)
    count = 0
    for metrics in steps:
        for key, value in metrics.items():
            sums[key] += value
        count += 1
    return {key: value / max(count, 1) for key, value in sums.items()}


def update_permutation(rows: int, seed: int, step: int):
    """The order a step's `rows` rows are updated in, drawn from (seed, step) alone: the same step
    of a resumed run takes the same order, whatever ran before it."""
    import torch

    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + step))


def shuffled(batch: TrainBatch, seed: int, step: int) -> TrainBatch:
    """A copy of the batch, its rows in `update_permutation`'s order."""
    return batch.select(update_permutation(len(batch), seed, step))
