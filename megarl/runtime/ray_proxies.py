"""Driver-side proxies of the Ray actors (megarl.runtime.ray_actors), each implementing the
same typed interface as its in-process counterpart: `RemoteTrainWorker` a `TrainWorker`,
`RemoteEngine` a `RolloutEngine`, `RemoteRewardPool` a `RewardComputer`, `RayRanks` the
`TrainRanks` a weight transport drives. A rank or actor that dies or fails is reported by
name (`ComponentDied`) instead of leaving the others waiting in a collective. Main entry
points: those four, `gather_ranks`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import ray
import torch

from megarl.backends.batch import TrainBatch
from megarl.errors import ComponentDied
from megarl.reward.scoring import RewardRequest, RewardResult
from megarl.reward.pool import RewardStats
from megarl.rollout.engine import GenerationOutput, SamplingParams
from megarl.weights.buckets import WeightBucket, flatten
from megarl.weights.transport import RankPlace, WeightSender

log = logging.getLogger(__name__)


def died(what: str, error: Exception) -> ComponentDied:
    return ComponentDied(f"{what} died: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")


def gather_ranks(refs: list) -> list:
    """Every rank's result, in rank order; the first failure raises ComponentDied naming its rank."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        rank = refs.index(ready[0])
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as e:
            raise died(f"train worker rank {rank} (Ray actor TrainWorkerActor)", e) from e
        except ray.exceptions.RayTaskError as e:
            if len(refs) == 1:
                raise  # the worker's own exception (Ray's error is also an instance of it)
            raise ComponentDied(f"train worker rank {rank} of {len(refs)} failed (the other ranks are stopped):\n"
                                f"{e}") from None
    return ray.get(refs)


class RemoteTrainWorker:
    """A `TrainWorker` whose ranks are actors: each method is a blocking call into every rank
    (they run in lockstep); the answer is rank 0's."""

    is_export_source = False  # the driver sends nothing: the rank actors do
    pipeline_stage = 0

    def __init__(self, actors: list, has_reference: bool):
        self.actors, self.has_reference = actors, has_reference

    def _on_every_rank(self, method: str, *args):
        args = tuple(ray.put(a) for a in args) if len(self.actors) > 1 else args  # one copy for all ranks
        return gather_ranks([a.run.remote(method, *args) for a in self.actors])[0]

    def compute_log_prob(self, batch: TrainBatch, with_entropy: bool = False):
        return self._on_every_rank("compute_log_prob", batch, with_entropy)

    def compute_ref_log_prob(self, batch: TrainBatch) -> torch.Tensor:
        return self._on_every_rank("compute_ref_log_prob", batch)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        return self._on_every_rank("compute_values", batch)

    def update_actor(self, batch: TrainBatch) -> dict[str, float]:
        return self._on_every_rank("update_actor", batch)

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        return self._on_every_rank("update_critic", batch)

    def export_hf_weights(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        raise NotImplementedError("the rank actors send their weights themselves (RayRanks.push); "
                                  "the driver never holds them")

    def weight_checksums(self) -> dict[str, str]:
        return self._on_every_rank("weight_checksums")

    def save_hf(self, directory: str | Path) -> str:
        return self._on_every_rank("save_hf", directory)

    def save_checkpoint(self, directory: str | Path) -> None:
        self._on_every_rank("save_checkpoint", directory)

    def load_checkpoint(self, directory: str | Path) -> None:
        self._on_every_rank("load_checkpoint", directory)


class RayRanks:
    """The rank actors as a weight transport drives them (megarl.weights.transport.TrainRanks)."""

    def __init__(self, actors: list):
        self.actors = actors
        self._places: list[RankPlace] | None = None

    def places(self) -> list[RankPlace]:
        if self._places is None:
            self._places = gather_ranks([a.place.remote(rank) for rank, a in enumerate(self.actors)])
        return self._places

    def free_address(self, rank: int) -> tuple[str, int]:
        return gather_ranks([self.actors[rank].address.remote()])[0]

    def open_senders(self, senders: Mapping[int, WeightSender]) -> Callable[[], None]:
        refs = [self.actors[rank].open_sender.remote(sender) for rank, sender in senders.items()]

        def wait() -> None:
            gather_ranks(refs)
        return wait

    def push(self, bucket_bytes: int, version: int, stage: int | None = None) -> int:
        return sum(gather_ranks([a.push_weights.remote(bucket_bytes, version, stage) for a in self.actors]))

    def free_cache(self) -> None:
        gather_ranks([a.free_cache.remote() for a in self.actors])


class RemoteRewardPool:
    """`RewardPool.compute` in the reward actor."""

    def __init__(self, actor):
        self.actor = actor

    def compute(self, requests: list[RewardRequest]) -> tuple[list[RewardResult], RewardStats]:
        try:
            return ray.get(self.actor.compute.remote(requests))
        except ray.exceptions.RayActorError as e:
            raise died("reward workers (Ray actor RewardActor)", e) from e

    def close(self) -> None:
        try:
            ray.get(self.actor.close.remote(), timeout=30)
        except (ray.exceptions.RayError, TimeoutError) as e:  # already gone: nothing left to close
            log.debug("reward actor close: %s", e)


class RemoteEngine:
    """A `RolloutEngine` whose engine lives in an actor (EngineActor). Picklable: a train
    rank holds one to send weights straight to the actor (the inprocess transport)."""

    NAME = "rollout engine (Ray actor EngineActor)"

    def __init__(self, actor):
        self.actor = actor

    async def _call(self, ref):
        try:
            return await ref
        except ray.exceptions.RayActorError as e:
            raise died(self.NAME, e) from e

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        return await self._call(self.actor.generate.remote(list(prompt_ids), params))

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Each bucket flattened into one buffer; two in flight, so the next is packed while
        the engine loads the last."""
        in_flight: list = []
        for bucket in buckets:
            in_flight.append(self.actor.load_bucket.remote(flatten(bucket), version))
            if len(in_flight) >= 2:
                await self._call(in_flight.pop(0))
        await asyncio.gather(*[self._call(ref) for ref in in_flight])

    async def begin_weight_update(self) -> None:
        await self._call(self.actor.begin_weight_update.remote())

    async def end_weight_update(self) -> None:
        await self._call(self.actor.end_weight_update.remote())

    async def pause(self) -> None:
        await self._call(self.actor.pause.remote())

    async def resume(self) -> None:
        await self._call(self.actor.resume.remote())

    async def flush_cache(self) -> None:
        await self._call(self.actor.flush_cache.remote())

    async def release_memory(self) -> None:
        await self._call(self.actor.release_memory.remote())

    async def resume_memory(self) -> None:
        await self._call(self.actor.resume_memory.remote())

    async def health(self) -> bool:
        return await self._call(self.actor.health.remote())

    async def weight_checksums(self) -> dict[str, str]:
        return await self._call(self.actor.weight_checksums.remote())

    def metrics(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        try:
            await self.actor.close.remote()
        except ray.exceptions.RayActorError as e:  # already gone: nothing left to close
            log.debug("engine actor close: %s", e)
