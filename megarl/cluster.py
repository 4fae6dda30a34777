"""Ray coordination: train worker, rollout engine, retrieval server and reward workers as Ray
actors in one placement group.

On one CPU machine Ray starts locally and everything fits one node; with
`cluster.ray_address=auto` (the slurm recipes) the same code joins a multi-node cluster.
The driver talks to the actors through small proxies with the same methods as the
in-process objects (megarl.remote), so `megarl.train` does not know which it has; with
rollout.engine=sglang the engines are the fleet's servers (megarl.rollout.sglang). The
search agent reaches the retrieval actor's HTTP server like any retriever. Weights go from
the worker actors to the engines directly, bucket by bucket, without passing through the
driver (`RayCluster.sync_weights`, by sync.transport). An actor that dies is reported by
name (`ComponentDied`). Main entry point: `RayCluster`.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl.components import ComponentDied, reward_spec
from megarl.config import RetrievalConfig, RunConfig
from megarl.remote import RemoteEngine, RemoteRewardPool, RemoteTrainWorker, died as _died, gather_ranks
from megarl.rollout.engine import GenerationOutput, SamplingParams

log = logging.getLogger(__name__)


def _load_model(cfg: RunConfig):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.trainer.seed)
    return AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))


@ray.remote
class TrainWorkerActor:
    """One rank of the train worker group: the torch backend's worker (a group of one) or a
    megatron rank. `setup` builds the worker; with several ranks every rank's setup joins
    one torch.distributed group (gloo on CPU, NCCL on GPUs) first."""

    def address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the process group."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, cfg: RunConfig, total_steps: int, rank: int, world_size: int, master: tuple[str, int]) -> bool:
        self.rank, self.sender = rank, None
        if cfg.actor.backend == "torch":
            from megarl.backends.torch.worker import TorchTrainWorker

            self.worker, self.is_source = TorchTrainWorker(_load_model(cfg), cfg, total_steps), True
            return self.worker.has_reference
        import os
        from datetime import timedelta

        import torch

        from megarl.backends.megatron.worker import MegatronTrainWorker

        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray gives each rank actor one GPU, visible as device 0
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=30))
        self.worker = MegatronTrainWorker(cfg, total_steps)
        self.is_source = self.worker.is_export_source
        return self.worker.has_reference

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def push_weights(self, engine, bucket_bytes: int, version: int) -> int:
        """Send this rank's flat buckets to the engine actor (megatron: each pipeline stage's
        source rank sends its stage; the other ranks only take part in the TP gathers);
        returns the number of buckets sent."""
        from megarl.sync import send_flat

        buckets = self._my_buckets(bucket_bytes)
        return send_flat(buckets, lambda flat: engine.load_bucket.remote(flat, version), ray.get) if self.is_source else 0

    def source(self) -> tuple[bool, str]:
        """(whether this rank sends its pipeline stage's weights, its node's address)."""
        return self.is_source, ray.util.get_node_ip_address()

    def _my_buckets(self, bucket_bytes: int):
        """This rank's export buckets if it is a source; otherwise the TP gathers are run
        (every rank must take part) and nothing is returned."""
        buckets = self.worker.export_hf_weights(bucket_bytes)
        if self.is_source:
            return buckets
        for _ in buckets:
            pass
        return []

    def push_to_disk(self, directory: str, bucket_bytes: int) -> int:
        """sync.transport=disk: this stage's buckets as safetensors files in `directory`."""
        from megarl.transport import write_buckets

        return len(write_buckets(self._my_buckets(bucket_bytes), directory, f"rank{self.rank:05d}"))

    def open_sender(self, address: str, port: int, world_size: int, group_name: str, engine_urls: list[str],
                    backend: str) -> None:
        """sync.transport=nccl: host the weight-update group `group_name` as its rank 0
        (returns once every engine rank has joined)."""
        from megarl.transport import DistributedSender, open_update_group

        self.close_sender()
        group = open_update_group(backend, address, port, 0, world_size, group_name)
        self.sender = DistributedSender(group, engine_urls, group_name)

    def close_sender(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def push_distributed(self, bucket_bytes: int, version: int) -> int:
        buckets = self._my_buckets(bucket_bytes)
        return self.sender.send(buckets, version) if self.is_source else 0

    def push_ipc(self, engines: list[tuple[str, int]], bucket_bytes: int, version: int) -> int:
        """sync.transport=ipc: CUDA IPC handles of each bucket to the engines (url, TP) on
        this rank's GPUs' node; each bucket stays alive until every engine has loaded it."""
        import httpx

        from megarl.transport import ipc_payload

        count = 0
        with httpx.Client(timeout=600) as client:
            for bucket in self._my_buckets(bucket_bytes):
                for url, tp in engines:
                    body, _buffer = ipc_payload(bucket, tp, version)  # the buffer lives until the engine answers
                    response = client.post(url + "/update_weights_from_tensor", json=body)
                    if response.status_code != 200 or not response.json().get("success"):
                        raise RuntimeError(f"{url} failed to load a weight bucket through CUDA IPC: "
                                           f"{response.status_code} {response.text[:500]}")
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

    async def load_bucket(self, bucket, version: int) -> None:
        """One flat bucket (megarl.sync.FlatBucket) from a trainer rank."""
        from megarl.sync import unpack_bucket

        await self.engine.update_weights([unpack_bucket(bucket)], version)

    async def call(self, method: str) -> object:
        return await getattr(self.engine, method)()


@ray.remote
class RetrievalActor:
    """megarl's retrieval server (FastAPI + uvicorn, as `megarl retrieval serve`) in its own process."""

    def __init__(self, r: RetrievalConfig):
        from megarl.retrieval.index import load_index
        from megarl.retrieval.server import BackgroundServer, create_app

        self.server = BackgroundServer(create_app(load_index(r.index_dir), default_topk=r.topk), host=r.host,
                                       port=r.port).start()

    def url(self) -> str:
        host = self.server.host
        if host in ("0.0.0.0", "::", ""):  # bound to every interface: reach it through the node's address
            host = ray.util.get_node_ip_address()
        return f"http://{host}:{self.server.port}"

    def stop(self) -> None:
        self.server.stop()


@ray.remote
class RewardActor:
    """A RewardPool (and its worker processes, if any) in its own process."""

    def __init__(self, spec, num_workers: int, timeout_s: float):
        from megarl.reward import RewardPool

        self.pool = RewardPool(spec, num_workers=num_workers, timeout_s=timeout_s)

    def compute(self, requests):
        return self.pool.compute(requests)

    def close(self) -> None:
        self.pool.close()


class RayCluster:
    """Starts (or joins) Ray, reserves a placement group, and creates the actors.

    Bundles, packed onto as few nodes as possible: each train worker rank (one with the torch
    backend, TP x PP x CP x DP with megatron) and the engine get one each ({"CPU": 1}, plus
    {"GPU": 1} when cluster.gpus_per_node > 0); the retrieval server and the reward actor
    share a {"CPU": 1} bundle. A local Ray is started with at least as many logical CPUs
    (scheduling slots, not cores) as bundles, so a 2-core machine runs it all.
    """

    def __init__(self, cfg: RunConfig, total_steps: int):
        self.cfg = cfg
        self._started_ray = False
        world = cfg.train_world_size()
        if not ray.is_initialized():
            c = cfg.cluster
            if c.ray_address:
                ray.init(address=c.ray_address, log_to_driver=True)
            else:
                ray.init(num_cpus=c.cpus_per_node or max(len(plan_bundles(cfg)[0]), _cpu_count()), num_gpus=c.gpus_per_node,
                         include_dashboard=False, log_to_driver=True)
            self._started_ray = True
        self.pg, self.worker_actors, self.engine_actor, self.reward_actor, self.retrieval_actor = None, [], None, None, None
        self.fleet, self.colocated, self._engine_memory_released, self._update_groups = None, False, False, {}
        try:
            self._start(cfg, total_steps, world)
        except BaseException:
            self.shutdown()  # nothing left behind by a start that failed half-way
            raise

    def _start(self, cfg: RunConfig, total_steps: int, world: int) -> None:
        gpus = 1 if cfg.cluster.gpus_per_node else 0
        fleet = cfg.rollout.engine == "sglang"
        self.colocated = fleet and gpus and cfg.rollout.mode == "colocated"
        bundles, engine_bundles = plan_bundles(cfg)
        misc = len(bundles) - 1
        self.pg = placement_group(bundles, strategy="PACK", name="megarl")
        ready, _ = ray.wait([self.pg.ready()], timeout=120)
        if not ready:
            raise RuntimeError(f"Ray could not reserve {bundles} within 120 s; available: "
                               f"{ray.available_resources()} — add resources or lower the request")
        place = [PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i)
                 for i in range(len(bundles))]
        train_gpus = 0.8 if self.colocated else gpus  # a colocated engine server takes the other 0.2
        self.worker_actors = [TrainWorkerActor.options(num_cpus=1, num_gpus=train_gpus, scheduling_strategy=place[r])
                              .remote() for r in range(world)]
        self.reward_actor = RewardActor.options(num_cpus=0.5, scheduling_strategy=place[misc]).remote(
            reward_spec(cfg), cfg.reward.num_workers, cfg.reward.timeout_s)
        self.retrieval_actor = None
        if cfg.agent.max_turns > 0 and cfg.agent.retrieval.url is None:
            self.retrieval_actor = RetrievalActor.options(num_cpus=0.5, scheduling_strategy=place[misc]).remote(
                cfg.agent.retrieval)
        master = ray.get(self.worker_actors[0].address.remote())
        has_reference = gather_ranks([a.setup.remote(cfg, total_steps, r, world, master)
                                      for r, a in enumerate(self.worker_actors)])[0]
        self.worker = RemoteTrainWorker(self.worker_actors, has_reference)
        if fleet:
            from megarl.rollout.sglang import launch_fleet

            out = Path(cfg.trainer.output_dir).resolve()
            weight_dir = Path(cfg.sync.disk_dir or out / "weight_sync").resolve()
            weight_dir.mkdir(parents=True, exist_ok=True)
            self.fleet = self.engine = launch_fleet(cfg, self.pg, engine_bundles, misc, str(out / "logs"),
                                                    str(weight_dir))
            self.weight_dir = weight_dir
        else:
            self.engine_actor = EngineActor.options(num_cpus=1, num_gpus=gpus, scheduling_strategy=place[world],
                                                    max_concurrency=1000).remote(cfg)
            self.engine = RemoteEngine(self.engine_actor)
        self.reward_pool = RemoteRewardPool(self.reward_actor)
        self.retrieval_url = None
        if self.retrieval_actor is not None:
            try:
                self.retrieval_url = ray.get(self.retrieval_actor.url.remote())
            except ray.exceptions.RayActorError as e:
                raise _died(f"retrieval server (Ray actor RetrievalActor serving {cfg.agent.retrieval.index_dir})",
                            e) from e

    def check_retrieval(self) -> None:
        """ComponentDied when the retrieval actor is gone."""
        if self.retrieval_actor is None:
            return
        try:
            ray.get(self.retrieval_actor.url.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise _died(f"retrieval server at {self.retrieval_url} (Ray actor RetrievalActor)", e) from e

    def sync_weights(self, version: int) -> None:
        """Trainer ranks -> engines with generation paused around it: actor to actor for the
        embedded engine, else by sync.transport (see megarl.transport)."""
        bucket_bytes = self.cfg.sync.bucket_mb << 20
        transport = self.cfg.sync_transport()
        if self.fleet is not None and not self._engine_memory_released:
            asyncio.run(self.fleet.check_engines())  # (colocated: checked before the memory was released)
        if self._engine_memory_released:  # colocated: weights back first, the KV cache after the sync
            asyncio.run(self.fleet.resume_memory(["weights"]))
        asyncio.run(self.engine.pause())
        try:
            if transport == "inprocess":
                gather_ranks([a.push_weights.remote(self.engine_actor, bucket_bytes, version)
                              for a in self.worker_actors])
            elif transport == "disk":
                directory = self.weight_dir / f"v{version:06d}"
                gather_ranks([a.push_to_disk.remote(str(directory), bucket_bytes) for a in self.worker_actors])
                asyncio.run(self.fleet.load_from_disk(str(directory), version))
            elif transport == "nccl":
                self._open_update_groups()
                gather_ranks([a.push_distributed.remote(bucket_bytes, version) for a in self.worker_actors])
            else:
                targets = self._ipc_targets()
                gather_ranks([a.push_ipc.remote(targets[r], bucket_bytes, version)
                              for r, a in enumerate(self.worker_actors)])
            asyncio.run(self.engine.flush_cache())
        finally:
            asyncio.run(self.engine.resume())
        if self._engine_memory_released:
            asyncio.run(self.fleet.resume_memory(["kv_cache"]))
            self._engine_memory_released = False

    def release_engine_memory(self) -> None:
        """Colocated engine servers free their GPU memory (weights and KV cache) for training."""
        if self.colocated and not self._engine_memory_released:
            asyncio.run(self.fleet.check_engines())  # a health check needs the KV cache: before releasing it
            asyncio.run(self.fleet.release_memory())
            self._engine_memory_released = True

    def _sources(self) -> list[tuple[int, str]]:
        """(rank, node address) of every rank that sends a pipeline stage's weights."""
        return [(r, node) for r, (is_source, node) in enumerate(ray.get([a.source.remote() for a in self.worker_actors]))
                if is_source]

    def _open_update_groups(self) -> None:
        """One weight-update group per source rank with every engine (again after an engine
        restart: a process group cannot take a new member)."""
        if self._update_groups and not self.fleet.update_groups_stale:
            return
        for rank, name in self._update_groups.items():
            ray.get(self.worker_actors[rank].close_sender.remote())
            asyncio.run(self.fleet.leave_update_group(name))
        self._update_groups = {}
        from megarl.transport import default_backend

        backend = "nccl" if self.cfg.cluster.gpus_per_node else default_backend()
        world, _ = self.fleet.group_ranks()
        for rank, _node in self._sources():
            name = f"megarl-sync-rank{rank}"
            address, port = ray.get(self.worker_actors[rank].address.remote())
            opened = self.worker_actors[rank].open_sender.remote(address, port, world, name, self.fleet.engine_urls,
                                                                 backend)
            asyncio.run(self.fleet.join_update_group(address, port, name, backend))
            gather_ranks([opened])
            self._update_groups[rank] = name
        self.fleet.update_groups_stale = False

    def _ipc_targets(self) -> list[list[tuple[str, int]]]:
        """For each train rank, the engines (url, TP) it feeds over CUDA IPC: a source rank
        feeds the engines on its node; every engine needs a source of each stage there."""
        sources = self._sources()
        targets = [[] for _ in self.worker_actors]
        for url, node, server in zip(self.fleet.engine_urls, self.fleet.engine_nodes, self.fleet.servers):
            local = [rank for rank, where in sources if where == node]
            if len(local) != len(sources):
                raise RuntimeError(f"sync.transport=ipc: engine {server.name} on node {node} has source ranks of "
                                   f"{len(local)} of the {len(sources)} pipeline stages on its node; CUDA IPC cannot "
                                   "cross nodes: use sync.transport=nccl")
            for rank in local:
                targets[rank].append((url, server.tp))
        return targets

    def shutdown(self) -> None:
        if self.fleet is not None:
            from megarl.rollout.sglang import stop_fleet

            stop_fleet(self.fleet)
        for actor in (*self.worker_actors, self.engine_actor, self.reward_actor, self.retrieval_actor):
            if actor is not None:
                ray.kill(actor)
        if self.pg is not None:
            remove_placement_group(self.pg)
        if self._started_ray:
            ray.shutdown()


def plan_bundles(cfg: RunConfig) -> tuple[list[dict], list[list[int]]]:
    """(placement-group bundles, bundle indices of each engine). Bundles: one per train rank,
    the engines' own (the embedded engine actor; fleet servers unless colocated, one per GPU
    of each engine), and a last one for the retrieval server, reward actor and router."""
    world, gpus = cfg.train_world_size(), cfg.cluster.gpus_per_node > 0
    device = {"CPU": 1} | ({"GPU": 1} if gpus else {})
    engines, tp = cfg.num_rollout_engines(), cfg.rollout.tensor_parallel_size
    if cfg.rollout.engine == "local":
        engine_bundles = [[world]]
    elif gpus and cfg.rollout.mode == "colocated":  # on the train ranks' GPUs
        engine_bundles = [[e * tp + j for j in range(tp)] for e in range(engines)]
    else:
        per_engine = tp if gpus else 1
        engine_bundles = [[world + e * per_engine + j for j in range(per_engine)] for e in range(engines)]
    own = sum(1 for b in engine_bundles for i in b if i >= world)
    return [device] * (world + own) + [{"CPU": 1}], engine_bundles


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 2

