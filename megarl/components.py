"""Build a run's components from its config: tokenizer, prompts, engine, train worker,
retriever, reward pool, tracker — and close them again.

`megarl.train` calls `build_components` once and then only uses what it returns; keeping
construction here keeps the loop readable. Main entry point: `build_components`.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from megarl.backends.torch.worker import TorchTrainWorker
from megarl.config import RunConfig
from megarl.errors import ComponentDied  # noqa: F401 (raised here, imported from here by callers)
from megarl.data.prompts import PromptRecord, PromptSampler, load_prompts
from megarl.reward import RewardPool, RewardSpec
from megarl.rollout.agent import AgentSettings
from megarl.rollout.local import LocalEngine
from megarl.sync import load_into_engine, verify_engine

log = logging.getLogger(__name__)


@dataclass
class Components:
    cfg: RunConfig
    tokenizer: object
    train_records: list[PromptRecord]
    val_records: list[PromptRecord]
    sampler: PromptSampler
    engine: object  # a RolloutEngine: LocalEngine or remote.RemoteEngine, rollout.sglang.SGLangFleet
    worker: object  # a TrainWorker: TorchTrainWorker or remote.RemoteTrainWorker
    reward_pool: object  # RewardPool or remote.RemoteRewardPool
    searcher: object | None
    total_steps: int
    dropped_prompts: int
    closers: ExitStack = field(default_factory=ExitStack)
    last_samples: list = field(default_factory=list)  # the latest training samples, for the rollout table
    ray_cluster: object | None = None
    retrieval_server: object | None = None  # the in-process BackgroundServer, when this process runs it

    def sync_weights(self, version: int) -> None:
        """Trainer weights -> engine in flat buckets of sync.bucket_mb (megarl.sync), then,
        with sync.verify, the engine's checksums against the trainer's."""
        if self.ray_cluster is not None:
            self.ray_cluster.sync_weights(version)
        else:
            buckets = self.worker.export_hf_weights(self.cfg.sync.bucket_mb << 20)
            asyncio.run(load_into_engine(self.engine, buckets, version))
        if self.cfg.sync.verify:
            asyncio.run(verify_engine(self.engine, self.worker.weight_checksums()))

    def release_engine_memory(self) -> None:
        """After the rollouts: colocated engine servers give their GPU memory to the trainer
        (the next sync_weights takes it back)."""
        if self.ray_cluster is not None:
            self.ray_cluster.release_engine_memory()

    def engine_metrics(self) -> dict[str, float]:
        """The fleet's restarts and re-sent requests so far (nothing for the embedded engine)."""
        metrics = getattr(self.engine, "metrics", None)
        return metrics() if callable(metrics) else {}

    def check_retrieval(self) -> None:
        """After failed searches: ComponentDied naming the retrieval server when it is gone or
        does not answer its health check; transient failures (it answers) pass."""
        if self.searcher is None:
            return
        if self.ray_cluster is not None:
            self.ray_cluster.check_retrieval()
        base = self.searcher.url.removesuffix("/retrieve")
        try:
            response = httpx.get(base + "/health", timeout=self.cfg.agent.retrieval.timeout_s)
            response.raise_for_status()
        except httpx.HTTPError as e:
            where = " (Ray actor RetrievalActor)" if self.ray_cluster and self.ray_cluster.retrieval_actor else ""
            raise ComponentDied(f"retrieval server at {base}{where} is not answering: {type(e).__name__}: {e}") from e

    def agent_settings(self, validation: bool = False) -> AgentSettings:
        c, s = self.cfg, (self.cfg.rollout.val if validation else self.cfg.rollout)
        return AgentSettings(max_turns=c.agent.max_turns, max_turn_length=c.agent.max_turn_length,
                             max_obs_length=c.agent.max_obs_length, max_response_length=c.rollout.max_response_length,
                             topk=c.agent.retrieval.topk, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)

    def close(self) -> None:
        self.closers.close()


def reward_spec(cfg: RunConfig) -> RewardSpec:
    r = cfg.reward
    return RewardSpec(custom_function=r.custom_function, weights=dict(r.weights), format_score=r.format_score,
                      structure_format_score=r.structure_format_score, final_format_score=r.final_format_score,
                      retrieval_score=r.retrieval_score, repetition_ngram_size=r.repetition_ngram_size,
                      repetition_max_penalty=r.repetition_max_penalty, cosine_max_len=r.cosine_max_len,
                      overlong_max_response_length=cfg.rollout.max_response_length,
                      overlong_buffer_len=cfg.algorithm.overlong.buffer_len,
                      overlong_penalty_factor=cfg.algorithm.overlong.penalty_factor)


def build_components(cfg: RunConfig) -> Components:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path = Path(cfg.model.path)
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"model.path={cfg.model.path} is not an HF model directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    d = cfg.data
    train_records, dropped = load_prompts(d.train_files, tokenizer, prompt_key=d.prompt_key,
                                          max_prompt_length=d.max_prompt_length,
                                          apply_chat_template=d.apply_chat_template)
    val_records = []
    if d.val_files:
        val_records, _ = load_prompts(d.val_files, tokenizer, prompt_key=d.prompt_key,
                                      max_prompt_length=d.max_prompt_length, apply_chat_template=d.apply_chat_template)
    steps_per_epoch = max(len(train_records) // d.train_batch_size, 1)
    total_steps = cfg.trainer.total_training_steps or steps_per_epoch * cfg.trainer.total_epochs

    closers = ExitStack()
    ray_cluster = None
    if cfg.cluster.launcher == "ray":
        from megarl.cluster import RayCluster

        ray_cluster = RayCluster(cfg, total_steps)
        closers.callback(ray_cluster.shutdown)
        worker, engine, pool = ray_cluster.worker, ray_cluster.engine, ray_cluster.reward_pool
    else:
        torch.manual_seed(cfg.trainer.seed)
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))
        worker = TorchTrainWorker(model, cfg, total_steps=total_steps)
        engine = LocalEngine(copy.deepcopy(model).eval(), tokenizer, max_batch_size=cfg.rollout.max_concurrency,
                             seed=cfg.trainer.seed)
        pool = RewardPool(reward_spec(cfg), num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s)
    closers.callback(lambda: asyncio.run(engine.close()))
    closers.callback(pool.close)
    searcher, server = None, None
    if cfg.agent.max_turns > 0:
        searcher, server = _connect_retrieval(cfg, closers, ray_cluster)
    return Components(cfg, tokenizer, train_records, val_records,
                      PromptSampler(len(train_records), cfg.trainer.seed, d.shuffle), engine, worker, pool, searcher,
                      total_steps, dropped, closers, ray_cluster=ray_cluster, retrieval_server=server)


def _connect_retrieval(cfg: RunConfig, closers: ExitStack, ray_cluster):
    """(client, in-process server or None): agent.retrieval.url, else the Ray cluster's
    retrieval actor, else a server started in this process on index_dir."""
    from megarl.retrieval import RetrievalClient

    r = cfg.agent.retrieval
    url, server = r.url, None
    if url is None and ray_cluster is not None:
        url = ray_cluster.retrieval_url
    elif url is None:
        from megarl.retrieval.index import load_index
        from megarl.retrieval.server import BackgroundServer, create_app

        server = BackgroundServer(create_app(load_index(r.index_dir), default_topk=r.topk), host=r.host, port=r.port)
        server.start()
        closers.callback(server.stop)
        url = server.url
    log.info("retrieval server on %s%s", url, f" serving {r.index_dir}" if r.url is None else "")
    return RetrievalClient(url, timeout_s=r.timeout_s, max_retries=r.max_retries), server
