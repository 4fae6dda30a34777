"""The Ray actors of a run that hold a model: each train rank and the embedded engine, each in
a process of its own (placed by megarl.runtime.ray_runtime; the others: megarl.runtime.service_actors).

The driver reaches them through the proxies of megarl.runtime.ray_proxies, which give them
the same typed interfaces as the in-process objects. Main entry points: `TrainWorkerActor`,
`EngineActor`.
"""

from __future__ import annotations

import os

import ray

from megarl.config import RunConfig
from megarl.rollout.engine import GenerationOutput, SamplingParams
from megarl.runtime.base import RankEndpoint
from megarl.runtime.liveness import HEALTH_GROUP
from megarl.runtime.stored_rows import fetched
from megarl.weights.buckets import FlatBucket, unpack_bucket
from megarl.weights.transport import RankPlace, WeightSender


def load_model(cfg: RunConfig):
    """The policy's initial weights as an HF model, seeded like every other copy of it."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.trainer.seed)
    return AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))


def sharers(bundle_nodes: dict[int, str], world: int, engine_concurrent: bool) -> list[int]:
    """For bundles 0..world (the train ranks, then the embedded engine): how many of the actors
    that compute at once share that bundle's node. The train ranks of a node share it; the
    engine shares it with them only when it generates while they train (asynchronous rollouts),
    and otherwise has the node to itself while the ranks wait."""
    def ranks_on(node: str) -> int:
        return sum(bundle_nodes[r] == node for r in range(world))
    engine_node = bundle_nodes[world]
    out = [ranks_on(bundle_nodes[r]) + (engine_concurrent and bundle_nodes[r] == engine_node) for r in range(world)]
    return out + [ranks_on(engine_node) + 1 if engine_concurrent else 1]


def use_threads(configured: int | None, sharing: int) -> int:
    """This actor's CPU threads: `configured` (cluster.threads_per_rank), or the cores it may
    run on divided among the `sharing` actors of its node that compute at once (`sharers`). Ray sets OMP_NUM_THREADS to an
    actor's num_cpus (1 here), which would leave a CPU machine's update on one core."""
    import torch

    threads = configured or max(1, len(os.sched_getaffinity(0)) // sharing)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for the processes it starts
    return threads


@ray.remote(concurrency_groups=HEALTH_GROUP)
class TrainWorkerActor:
    """One rank of the train worker group: the torch backend's worker (a group of one) or a
    megatron rank. `setup` builds the worker; with several ranks every rank's setup joins
    one torch.distributed group (gloo on CPU, NCCL on GPUs) first. `run` calls a TrainWorker
    method (megarl.backends.base) on this rank's worker."""

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, cfg: RunConfig, total_steps: int, rank: int, world_size: int, master: tuple[str, int],
              sharing: int = 1) -> bool:
        use_threads(cfg.cluster.threads_per_rank, sharing)
        if cfg.actor.backend == "torch":
            from megarl.backends.torch.worker import TorchTrainWorker

            self.worker = TorchTrainWorker(load_model(cfg), cfg, total_steps)
        else:
            self.worker = _megatron_worker(cfg, total_steps, rank, world_size, master)
        self.endpoint = RankEndpoint(self.worker)
        return self.worker.has_reference

    def run(self, method: str, *args):
        return getattr(self.worker, method)(*fetched(args))

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        """Answered on a thread of its own while a call runs (megarl.runtime.liveness)."""
        return 0

    def place(self, rank: int) -> RankPlace:
        """Where this rank runs (node, GPU) and what it holds of the exported weights."""
        gpus = ray.get_gpu_ids()
        return self.endpoint.place(rank, ray.util.get_node_ip_address(), str(gpus[0]) if gpus else "")

    def free_cache(self) -> None:
        self.endpoint.free_cache()

    def open_sender(self, sender: WeightSender) -> None:
        self.endpoint.open_sender(sender)

    def push_weights(self, bucket_bytes: int, version: int, stage: int | None = None) -> int:
        return self.endpoint.push(bucket_bytes, version, stage)


def _megatron_worker(cfg: RunConfig, total_steps: int, rank: int, world_size: int, master: tuple[str, int]):
    import os
    from datetime import timedelta

    import torch

    from megarl.backends.megatron.model import rank_environment
    from megarl.backends.megatron.worker import MegatronTrainWorker

    os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    parallel = cfg.actor.parallel  # before CUDA starts in this process (torch.cuda below)
    os.environ.update(rank_environment(parallel.tensor_model_parallel_size, parallel.context_parallel_size))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)  # Ray gives each rank actor one GPU, visible as device 0
    torch.distributed.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=30))
    return MegatronTrainWorker(cfg, total_steps)


@ray.remote(concurrency_groups=HEALTH_GROUP)
class EngineActor:
    """The embedded engine in its own process; an async actor, so many generate calls run at once."""

    def __init__(self, cfg: RunConfig, sharing: int = 1):
        from transformers import AutoTokenizer

        from megarl.rollout.local import LocalEngine

        use_threads(cfg.cluster.threads_per_rank, sharing)

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        self.engine = LocalEngine(load_model(cfg).eval(), tokenizer, max_batch_size=cfg.rollout.max_concurrency,
                                  kv_cache_tokens=cfg.rollout.kv_cache_tokens,
                                  seed=cfg.trainer.seed, record_routing=cfg.actor.moe_routing_replay)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        return await self.engine.generate(prompt_ids, params)

    async def load_bucket(self, bucket: FlatBucket, version: int) -> None:
        """One flat bucket from a trainer rank."""
        await self.engine.update_weights([unpack_bucket(bucket)], version)

    async def abort_requests(self) -> None:
        await self.engine.abort_requests()

    async def begin_weight_update(self) -> None:
        await self.engine.begin_weight_update()

    async def end_weight_update(self) -> None:
        await self.engine.end_weight_update()

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def flush_cache(self) -> None:
        await self.engine.flush_cache()

    async def release_memory(self) -> None:
        await self.engine.release_memory()

    async def resume_memory(self) -> None:
        await self.engine.resume_memory()

    async def health(self) -> bool:
        return await self.engine.health()

    @ray.method(concurrency_group="health")
    async def ping(self) -> int:
        """The tokens generated so far, answered on an event loop of its own (megarl.runtime.liveness)."""
        return self.engine.tokens_generated

    async def weight_checksums(self) -> dict[str, str]:
        return await self.engine.weight_checksums()

    async def probe_log_probs(self, sequences: list[list[int]]) -> dict[str, list[list[float]]]:
        return await self.engine.probe_log_probs(sequences)

    async def close(self) -> None:
        await self.engine.close()
