"""The inprocess transport: buckets handed to the engine object itself, for the embedded
engine (rollout.engine=local).

In one process the engine takes the trainer's tensors as they are; when the engine lives
in a Ray actor, `engines` is its proxy (megarl.runtime.ray_proxies.RemoteEngine), which
flattens each bucket into one buffer and keeps two in flight. Main entry points:
`InProcessTransport`, `load_into_engine`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from megarl.driver_loop import run_async
from megarl.weights.buckets import FlatBucket, WeightBucket, unpack_bucket
from megarl.weights.transport import TrainRanks, WeightSender, WeightTransport, sources


class EngineSender(WeightSender):
    """Every bucket into `engine.update_weights` (a RolloutEngine, local or a picklable proxy)."""

    def __init__(self, engine: Any):
        self.engine = engine

    def send(self, buckets: Iterable[WeightBucket], version: int) -> int:
        async def load() -> int:
            count = 0
            for bucket in buckets:
                await self.engine.update_weights([bucket], version)
                count += 1
            return count
        return run_async(load())


class InProcessTransport(WeightTransport):
    name = "inprocess"

    @classmethod
    def check(cls, cfg: Any, problems: Any) -> None:
        if cfg.rollout.engine != "local":
            problems.add("sync.transport", "inprocess needs the embedded engine (rollout.engine=local)",
                         "use auto, ipc, nccl or disk with rollout.engine=sglang")

    def senders(self, ranks: TrainRanks) -> dict[int, WeightSender]:
        return {p.rank: EngineSender(self.engines) for p in sources(ranks)}


async def load_into_engine(engine: Any, buckets: Iterable[FlatBucket | Mapping[str, torch.Tensor]],
                           version: int) -> int:
    """Pause the engine, load every bucket, flush its cache, resume; returns the number of
    tensors loaded. The engine resumes even when a bucket fails (the error propagates)."""
    await engine.pause()
    count = 0
    try:
        for bucket in buckets:
            tensors = unpack_bucket(bucket) if isinstance(bucket, FlatBucket) else dict(bucket)
            await engine.update_weights([tensors], version)
            count += len(tensors)
        await engine.flush_cache()
    finally:
        await engine.resume()
    return count
