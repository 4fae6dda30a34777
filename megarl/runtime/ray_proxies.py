"""Driver-side proxies of the Ray actors (megarl.runtime.ray_actors), each implementing the
same typed interface as its in-process counterpart: `RemoteTrainWorker` a `TrainWorker`,
`RemoteEngine` a `RolloutEngine`, `RemoteRewardPool` a `RewardComputer`, `RayRanks` the
`TrainRanks` a weight transport drives. A rank or actor that dies, fails or freezes is
reported by name (`ComponentDied`, megarl.runtime.liveness) instead of leaving the others
waiting in a collective or the driver waiting forever. Main entry points: those four.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import ray
import torch

from megarl.backends.batch import RaggedRows
from megarl.backends.packed import DataShare, PackedBatch, iter_forward_shares, iter_update_shares
from megarl.driver_loop import run_async
from megarl.reward.scoring import RewardRequest, RewardResult
from megarl.reward.pool import RewardStats
from megarl.rollout.engine import GenerationOutput, SamplingParams
from megarl.runtime.liveness import ActorWatch, Liveness, bounded, gather_watched
from megarl.runtime.stored_rows import RoutingInStore, cuts
from megarl.weights.buckets import WeightBucket, flatten
from megarl.weights.transport import RankPlace, WeightSender

log = logging.getLogger(__name__)


def rank_name(rank: int) -> str:
    return f"train worker rank {rank} (Ray actor TrainWorkerActor)"


class _Ranks:
    """Calls into every rank actor (or some), watched (megarl.runtime.liveness). `nodes`: where
    each rank runs ("node NAME (ADDRESS)"), named with it in errors once the runtime knows."""

    def __init__(self, actors: list, liveness: Liveness):
        self.actors, self.liveness = actors, liveness
        self.nodes: dict[int, str] = {}

    def name(self, rank: int) -> str:
        return rank_name(rank) + (f" on {self.nodes[rank]}" if rank in self.nodes else "")

    def gather(self, refs: list, ranks: list[int] | None = None, keep: list[int] | None = None,
               peers: Sequence[tuple[object, str]] = ()) -> list:
        """Each ref's result (`keep`: of those refs only); refs[i] is served by rank ranks[i] (all
        ranks in order by default); `peers` watched too (liveness.gather_watched)."""
        ranks = list(range(len(self.actors))) if ranks is None else ranks
        return gather_watched(refs, [self.actors[r] for r in ranks], lambda i: self.name(ranks[i]), self.liveness,
                              keep, peers)


class RemoteTrainWorker(_Ranks):
    """A `TrainWorker` whose ranks are actors: each method is a blocking call into every rank
    (they run in lockstep); the answer is rank 0's.

    A packed batch (megarl.backends.packed) is not sent whole to every rank: each data-parallel
    rank's share is put in Ray's object store once and read by the ranks of that share (its
    TP / PP / CP peers); the routing of routing replay once a step, whatever the calls
    (megarl.runtime.stored_rows). For an update the share is a contiguous part of every mini-batch of
    `mini_rows[part]` rows, as the Megatron backend trains on; for a forward pass a run of
    consecutive rows, whose results come back from one rank of each share and nowhere else."""

    is_export_source = False  # the driver sends nothing: the rank actors do
    pipeline_stage = 0

    def __init__(self, actors: list, has_reference: bool, liveness: Liveness,
                 mini_rows: Mapping[str, int] | None = None):
        super().__init__(actors, liveness)
        self.has_reference, self.mini_rows = has_reference, dict(mini_rows or {})
        self.routing = RoutingInStore()
        self._layout: list[tuple[int, int]] | None = None

    def _on_every_rank(self, method: str, *args):
        args = tuple(ray.put(a) for a in args) if len(self.actors) > 1 else args  # one copy for all ranks
        return self.gather([a.run.remote(method, *args) for a in self.actors], keep=[0])[0]

    def data_layout(self) -> list[tuple[int, int]]:
        """(data-parallel rank, data-parallel size) of each rank, asked once."""
        if self._layout is None:
            self._layout = self.gather([a.run.remote("data_parallel") for a in self.actors])
        return self._layout

    def _shared(self, method: str, batch: PackedBatch, shares: Iterable[DataShare], *rest,
                answers: list[int]) -> list:
        if isinstance(batch.routed_experts, RaggedRows):  # put once a step, by piece (megarl.runtime.stored_rows)
            at = cuts(len(batch), self.data_layout()[0][1], self.mini_rows.values())
            shares = (self.routing.share(s, batch.routed_experts, at) for s in shares)
        refs = [ray.put(s) for s in shares]  # built one at a time, each dropped once in the object store
        calls = [a.run.remote(method, refs[dp], *rest) for a, (dp, _) in zip(self.actors, self.data_layout())]
        return self.gather(calls, keep=answers)

    def _forward(self, method: str, batch, *rest):
        if len(self.actors) == 1 or not isinstance(batch, PackedBatch):
            return self._on_every_rank(method, batch, *rest)
        size = self.data_layout()[0][1]
        first = [self.data_layout().index((dp, size)) for dp in range(size)]  # one rank of each share answers
        parts = self._shared(method, batch, iter_forward_shares(batch, size), *rest, answers=first)
        if isinstance(parts[0], tuple):
            return tuple(None if p[0] is None else torch.cat(list(p)) for p in zip(*parts))
        return torch.cat(parts)

    def _update(self, method: str, part: str, batch):
        if len(self.actors) == 1 or not isinstance(batch, PackedBatch) or part not in self.mini_rows:
            return self._on_every_rank(method, batch)
        size = self.data_layout()[0][1]
        return self._shared(method, batch, iter_update_shares(batch, size, self.mini_rows[part]), answers=[0])[0]

    def compute_log_prob(self, batch: PackedBatch, with_entropy: bool = False, temperature: float | None = None,
                         own_routing: bool = False):
        return self._forward("compute_log_prob", batch, with_entropy, temperature, own_routing)

    def compute_ref_log_prob(self, batch: PackedBatch) -> torch.Tensor:
        return self._forward("compute_ref_log_prob", batch)

    def compute_values(self, batch: PackedBatch) -> torch.Tensor:
        return self._forward("compute_values", batch)

    def update_actor(self, batch: PackedBatch) -> dict[str, float]:
        return self._update("update_actor", "actor", batch)

    def update_critic(self, batch: PackedBatch) -> dict[str, float]:
        return self._update("update_critic", "critic", batch)

    def sleep(self, keep_weights: bool = False) -> float:
        return max(self.gather([a.run.remote("sleep", keep_weights) for a in self.actors]))  # the slowest rank's

    def wake(self, weights_only: bool = False) -> float:
        return max(self.gather([a.run.remote("wake", weights_only) for a in self.actors]))

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


class RayRanks(_Ranks):
    """The rank actors as a weight transport drives them (megarl.weights.transport.TrainRanks)."""

    def __init__(self, actors: list, liveness: Liveness):
        super().__init__(actors, liveness)
        self._places: list[RankPlace] | None = None
        self.engines: list[tuple[object, str]] = []  # (actor, name) of the engines a push sends to

    def places(self) -> list[RankPlace]:
        if self._places is None:
            self._places = self.gather([a.place.remote(rank) for rank, a in enumerate(self.actors)])
        return self._places

    def free_address(self, rank: int) -> tuple[str, int]:
        return self.gather([self.actors[rank].address.remote()], [rank])[0]

    def open_senders(self, senders: Mapping[int, WeightSender]) -> Callable[[], None]:
        ranks = list(senders)
        refs = [self.actors[rank].open_sender.remote(senders[rank]) for rank in ranks]

        def wait() -> None:
            self.gather(refs, ranks)
        return wait

    def push(self, bucket_bytes: int, version: int, stage: int | None = None) -> int:
        return sum(self.gather([a.push_weights.remote(bucket_bytes, version, stage) for a in self.actors],
                               peers=self.engines))

    def free_cache(self) -> None:
        self.gather([a.free_cache.remote() for a in self.actors])


class RemoteRewardPool:
    """`RewardPool.compute` in the reward actor."""

    NAME = "reward workers (Ray actor RewardActor)"

    def __init__(self, actor, liveness: Liveness):
        self.actor, self.liveness = actor, liveness

    def compute(self, requests: list[RewardRequest]) -> tuple[list[RewardResult], RewardStats]:
        return gather_watched([self.actor.compute.remote(requests)], [self.actor], lambda _: self.NAME,
                              self.liveness)[0]

    def close(self) -> None:
        run_async(bounded(self.actor.close.remote(), 30, "closing the " + self.NAME))


class RemoteEngine:
    """A `RolloutEngine` whose engine lives in an actor (EngineActor). Picklable: a train
    rank holds one to send weights straight to the actor (the inprocess transport)."""

    NAME = "rollout engine (Ray actor EngineActor)"

    def __init__(self, actor, liveness: Liveness):
        self.actor = actor
        self.watch = ActorWatch(actor, self.NAME, liveness)

    async def _call(self, ref, generating: bool = False):
        return await self.watch.wait(ref, generating)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        return await self._call(self.actor.generate.remote(list(prompt_ids), params), generating=True)

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Each bucket flattened into one buffer; two in flight, so the next is packed while
        the engine loads the last."""
        in_flight: list = []
        for bucket in buckets:
            in_flight.append(self.actor.load_bucket.remote(flatten(bucket), version))
            if len(in_flight) >= 2:
                await self._call(in_flight.pop(0))
        await asyncio.gather(*[self._call(ref) for ref in in_flight])

    async def abort_requests(self) -> None:
        await self._call(self.actor.abort_requests.remote())

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

    async def probe_log_probs(self, sequences: list[list[int]]) -> dict[str, list[list[float]]]:
        return {self.NAME: (await self._call(self.actor.probe_log_probs.remote(sequences)))[
            "embedded engine"]}

    def metrics(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        await bounded(self.actor.close.remote(), 30, "closing the " + self.NAME)
