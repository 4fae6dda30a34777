"""Everything in this process (cluster.launcher=inprocess): the torch backend's worker, the
embedded engine on a copy of the model, the reward pool, and the retrieval server on a
thread. For debugging and tests; the same loop as on a cluster. Main entry point:
`InProcessRuntime`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping

import torch

from megarl.backends.torch.worker import TorchTrainWorker
from megarl.config import RunConfig
from megarl.driver_loop import run_async
from megarl.reward import RewardPool
from megarl.rollout.local import LocalEngine
from megarl.rollout.sglang_launch import free_port
from megarl.runtime.base import RankEndpoint, Runtime, hosted_retrieval_key
from megarl.weights import transport_class
from megarl.weights.transport import RankPlace, WeightSender


class LocalRanks:
    """The train worker group of one rank, in this process."""

    def __init__(self, endpoint: RankEndpoint):
        self.endpoint = endpoint

    def places(self) -> list[RankPlace]:
        return [self.endpoint.place(0, "127.0.0.1", "")]

    def free_address(self, rank: int) -> tuple[str, int]:
        return "127.0.0.1", free_port()

    def open_senders(self, senders: Mapping[int, WeightSender]) -> Callable[[], None]:
        for sender in senders.values():
            self.endpoint.open_sender(sender)
        return lambda: None

    def push(self, bucket_bytes: int, version: int, stage: int | None = None) -> int:
        return self.endpoint.push(bucket_bytes, version, stage)

    def free_cache(self) -> None:
        self.endpoint.free_cache()


class InProcessRuntime(Runtime):
    def __init__(self, cfg: RunConfig, total_steps: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg, self.retrieval_server, self._stopped = cfg, None, False
        torch.manual_seed(cfg.trainer.seed)
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        # the engine's copy first: with actor.lora the worker puts adapters into `model`
        self.engine = LocalEngine(copy.deepcopy(model).eval(), tokenizer, max_batch_size=cfg.rollout.max_concurrency,
                                  kv_cache_tokens=cfg.rollout.kv_cache_tokens,
                                  seed=cfg.trainer.seed, record_routing=cfg.actor.moe_routing_replay)
        self.worker = TorchTrainWorker(model, cfg, total_steps=total_steps)
        self.reward_pool = RewardPool(cfg.reward, num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
        self.ranks = LocalRanks(RankEndpoint(self.worker))
        self.transport = transport_class(cfg.sync_transport())(cfg, self.engine)
        try:
            self._start_retrieval()
        except BaseException:
            self.shutdown()
            raise

    def _start_retrieval(self) -> None:
        r = self.cfg.agent.retrieval
        if not self.cfg.agent.uses_search() or r.url is not None:
            return
        from megarl.retrieval.index import load_index
        from megarl.http_server import BackgroundServer
        from megarl.retrieval.server import create_app

        self.retrieval_api_key = hosted_retrieval_key(r)
        self.retrieval_server = BackgroundServer(create_app(load_index(r.index_dir), default_topk=r.topk,
                                                            api_key=self.retrieval_api_key),
                                                  host="127.0.0.1" if r.host == "auto" else r.host, port=r.port)
        self.retrieval_server.start()
        self.retrieval_url = self.retrieval_server.url

    def release_engine_memory(self) -> None:
        """The embedded engine shares nothing with the trainer but the host's memory."""

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.retrieval_server is not None:
            self.retrieval_server.stop()
        self.ranks.endpoint.close()
        run_async(self.engine.close())
        self.reward_pool.close()
