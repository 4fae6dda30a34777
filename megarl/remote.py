"""Driver-side proxies of the Ray actors (megarl.cluster): the same methods as the in-process
train worker, engine and reward pool, so `megarl.train` does not know which it has. A rank or
actor that dies or fails is reported by name (`ComponentDied`) instead of leaving the others
waiting in a collective. Main entry points: `RemoteTrainWorker`, `RemoteEngine`,
`RemoteRewardPool`, `gather_ranks`.
"""

from __future__ import annotations

import logging

import ray

from megarl.errors import ComponentDied
from megarl.rollout.engine import GenerationOutput, SamplingParams

log = logging.getLogger(__name__)


def died(what: str, error: Exception) -> ComponentDied:
    return ComponentDied(f"{what} died: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")


class RemoteTrainWorker:
    """The TrainWorker methods, each a blocking call into every rank actor of the group (they
    run in lockstep); the answer is rank 0's. A rank that dies or fails stops the call with
    ComponentDied naming it, instead of leaving the others waiting in a collective."""

    METHODS = ("compute_log_prob", "compute_ref_log_prob", "compute_values", "update_actor", "update_critic",
               "save_checkpoint", "load_checkpoint", "save_hf", "weight_checksums")

    def __init__(self, actors: list, has_reference: bool):
        self.actors, self.has_reference = actors, has_reference

    def __getattr__(self, method: str):
        if method not in self.METHODS:
            raise AttributeError(method)

        def call(*args):
            args = [ray.put(a) for a in args] if len(self.actors) > 1 else list(args)  # one copy for all ranks
            return gather_ranks([a.call.remote(method, *args) for a in self.actors])[0]

        return call


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


class RemoteRewardPool:
    """`RewardPool.compute` in the reward actor."""

    def __init__(self, actor):
        self.actor = actor

    def compute(self, requests):
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
    """A `RolloutEngine` whose engine lives in an actor."""

    def __init__(self, actor):
        self.actor = actor

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        try:
            return await self.actor.generate.remote(list(prompt_ids), params)
        except ray.exceptions.RayActorError as e:
            raise died("rollout engine (Ray actor EngineActor)", e) from e

    async def update_weights(self, buckets, version: int) -> None:
        for bucket in buckets:
            await self.actor.update_weights.remote([bucket], version)

    async def pause(self) -> None:
        await self.actor.call.remote("pause")

    async def resume(self) -> None:
        await self.actor.call.remote("resume")

    async def flush_cache(self) -> None:
        await self.actor.call.remote("flush_cache")

    async def release_memory(self) -> None:
        await self.actor.call.remote("release_memory")

    async def resume_memory(self) -> None:
        await self.actor.call.remote("resume_memory")

    async def health(self) -> bool:
        return await self.actor.call.remote("health")

    async def weight_checksums(self) -> dict[str, str]:
        return await self.actor.call.remote("weight_checksums")

    async def close(self) -> None:
        try:
            await self.actor.call.remote("close")
        except ray.exceptions.RayActorError as e:  # already gone: nothing left to close
            log.debug("engine actor close: %s", e)
