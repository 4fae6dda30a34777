"""Ray coordination: the train worker and the rollout engine as Ray actors in a placement group.

On one CPU machine Ray starts locally and everything fits one node; with
`cluster.ray_address=auto` (the slurm recipes) the same code joins a multi-node cluster.
The driver talks to the actors through small proxies with the same methods as the
in-process objects (`RemoteTrainWorker`, `RemoteEngine`), so `megarl.train` does not know
which it has. Weights go from the worker actor to the engine actor directly, bucket by
bucket, without passing through the driver. Main entry point: `RayCluster`.
"""

from __future__ import annotations

import logging

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl.config import RunConfig
from megarl.rollout.engine import GenerationOutput, SamplingParams

log = logging.getLogger(__name__)


def _load_model(cfg: RunConfig):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.trainer.seed)
    return AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))


@ray.remote
class TrainWorkerActor:
    def __init__(self, cfg: RunConfig, total_steps: int):
        from megarl.backends.torch.worker import TorchTrainWorker

        self.worker = TorchTrainWorker(_load_model(cfg), cfg, total_steps)

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def has_reference(self) -> bool:
        return self.worker.has_reference

    def push_weights(self, engine, bucket_bytes: int, version: int) -> int:
        """Send every bucket to the engine actor; returns the number of buckets."""
        count = 0
        for bucket in self.worker.export_hf_weights(bucket_bytes):
            ray.get(engine.update_weights.remote([bucket], version))
            count += 1
        return count


@ray.remote
class EngineActor:
    """The embedded engine in its own process; an async actor, so many generate calls run at once."""

    def __init__(self, cfg: RunConfig):
        from transformers import AutoTokenizer

        from megarl.rollout.local import LocalEngine

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        self.engine = LocalEngine(_load_model(cfg).eval(), tokenizer, max_batch_size=cfg.rollout.max_concurrency,
                                  seed=cfg.trainer.seed)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        return await self.engine.generate(prompt_ids, params)

    async def update_weights(self, buckets, version: int) -> None:
        await self.engine.update_weights(buckets, version)

    async def call(self, method: str) -> object:
        return await getattr(self.engine, method)()


class RemoteTrainWorker:
    """The TrainWorker methods, each a blocking call into the worker actor."""

    def __init__(self, actor):
        self.actor = actor
        self.has_reference = ray.get(actor.has_reference.remote())

    def __getattr__(self, method: str):
        if method not in ("compute_log_prob", "compute_ref_log_prob", "compute_values", "update_actor",
                          "update_critic", "save_checkpoint", "load_checkpoint", "save_hf"):
            raise AttributeError(method)
        return lambda *args: ray.get(self.actor.call.remote(method, *args))


class RemoteEngine:
    """A `RolloutEngine` whose engine lives in an actor."""

    def __init__(self, actor):
        self.actor = actor

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        return await self.actor.generate.remote(list(prompt_ids), params)

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

    async def close(self) -> None:
        await self.actor.call.remote("close")


class RayCluster:
    """Starts (or joins) Ray, reserves a placement group, and creates the actors.

    One bundle per actor ({"CPU": 1}, plus {"GPU": 1} when cluster.gpus_per_node > 0),
    packed onto as few nodes as possible.
    """

    def __init__(self, cfg: RunConfig, total_steps: int):
        self.cfg = cfg
        self._started_ray = False
        if not ray.is_initialized():
            c = cfg.cluster
            if c.ray_address:
                ray.init(address=c.ray_address, log_to_driver=True)
            else:
                ray.init(num_cpus=c.cpus_per_node or max(2, _cpu_count()), num_gpus=c.gpus_per_node,
                         include_dashboard=False, log_to_driver=True)
            self._started_ray = True
        bundle = {"CPU": 1} | ({"GPU": 1} if cfg.cluster.gpus_per_node else {})
        self.pg = placement_group([bundle, bundle], strategy="PACK", name="megarl")
        ready, _ = ray.wait([self.pg.ready()], timeout=120)
        if not ready:
            raise RuntimeError(f"Ray could not reserve {bundle} x 2 within 120 s; available: "
                               f"{ray.available_resources()} — add resources or lower the request")
        place = [PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i)
                 for i in range(2)]
        gpus = 1 if cfg.cluster.gpus_per_node else 0
        self.worker_actor = TrainWorkerActor.options(num_cpus=1, num_gpus=gpus, scheduling_strategy=place[0],
                                                     name=None).remote(cfg, total_steps)
        self.engine_actor = EngineActor.options(num_cpus=1, num_gpus=gpus, scheduling_strategy=place[1],
                                                max_concurrency=1000).remote(cfg)
        self.worker = RemoteTrainWorker(self.worker_actor)
        self.engine = RemoteEngine(self.engine_actor)

    def sync_weights(self, version: int) -> None:
        ray.get(self.worker_actor.push_weights.remote(self.engine_actor, self.cfg.sync.bucket_mb << 20, version))

    def shutdown(self) -> None:
        for actor in (self.worker_actor, self.engine_actor):
            ray.kill(actor)
        remove_placement_group(self.pg)
        if self._started_ray:
            ray.shutdown()


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 2

