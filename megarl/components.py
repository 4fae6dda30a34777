"""A run's components, built from its config: tokenizer, prompts and their order, the
runtime (train worker, rollout engine, reward pool, retrieval server: megarl.runtime), the
agent's tools and the retrieval client of its search — and closed again.

`megarl.train` calls `build_components` once and then only uses what it returns, through
the typed interfaces (`TrainWorker`, `RolloutEngine`, `RewardComputer`); it never knows
whether the parts run in this process or as Ray actors. Main entry point: `build_components`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass, field

import httpx

from megarl.backends.base import TrainWorker
from megarl.config import RunConfig
from megarl.data.prompts import PromptOrder, PromptRecord, data_corpus, load_prompts
from megarl.driver_loop import run_async
from megarl.errors import ComponentDied
from megarl.http_auth import RETRIEVAL_KEY_ENV
from megarl.models.hf_files import check_model_files
from megarl.retrieval.client import RetrievalClient
from megarl.retrieval.index import corpus_warnings
from megarl.reward.pool import RewardComputer
from megarl.reward.registry import check_data_sources
from megarl.rollout.agent import AgentSettings
from megarl.rollout.engine import RolloutEngine
from megarl.runtime import Runtime, build_runtime
from megarl.tools import build_toolset
from megarl.tools.base import ToolSet

log = logging.getLogger(__name__)


@dataclass
class Components:
    cfg: RunConfig
    tokenizer: object  # the policy's HF tokenizer
    train_records: list[PromptRecord]
    val_records: list[PromptRecord]
    prompt_order: PromptOrder
    runtime: Runtime
    searcher: RetrievalClient | None
    tools: ToolSet | None  # the agent's tools (agent.tools) where the run is multi-turn
    total_steps: int
    dropped_prompts: int
    last_samples: list = field(default_factory=list)  # the latest training samples, for the rollout table
    reward_lock: threading.Lock = field(default_factory=threading.Lock)  # one scoring at a time (megarl.async_rollouts)

    @property
    def worker(self) -> TrainWorker:
        return self.runtime.worker

    @property
    def engine(self) -> RolloutEngine:
        return self.runtime.engine

    @property
    def reward_pool(self) -> RewardComputer:
        return self.runtime.reward_pool

    def sync_weights(self, version: int) -> None:
        """Trainer weights -> engine (megarl.runtime.base.Runtime.sync_weights)."""
        self.runtime.sync_weights(version)

    def for_generation(self) -> None:
        """Before the engines generate: the trainer asleep (where it sleeps), their memory back."""
        self.runtime.for_generation()

    def for_training(self) -> None:
        """Before the trainer computes or saves: engines on its GPUs give it their memory, it wakes."""
        self.runtime.for_training()

    def engine_metrics(self) -> dict[str, float]:
        """The engine's counters so far (the fleet's restarts and re-sent requests, the weights
        reloaded after a failed probe; the probe's noise floor and tolerance, once calibrated)."""
        probe = self.runtime.probe
        calibrated = {} if probe is None or probe.floor is None else {
            "rollout/probe_noise_floor": probe.floor, "rollout/probe_tolerance": probe.tolerance}
        return self.engine.metrics() | {"rollout/weight_reloads": float(self.runtime.weight_reloads)} | calibrated

    def check_retrieval(self) -> None:
        """After failed searches: ComponentDied naming the retrieval server when it is gone or
        does not answer its health check; transient failures (it answers) pass."""
        if self.searcher is None:
            return
        self.runtime.check_retrieval()
        base = self.searcher.url.removesuffix("/retrieve")
        try:
            response = httpx.get(base + "/health", timeout=self.cfg.agent.retrieval.timeout_s)
            response.raise_for_status()
        except httpx.HTTPError as e:
            where = self.runtime.retrieval_where if self.runtime.retrieval_url else ""
            raise ComponentDied(f"retrieval server at {base}{where} is not answering: {type(e).__name__}: {e}") from e

    def agent_settings(self, validation: bool = False) -> AgentSettings:
        c, s = self.cfg, (self.cfg.rollout.val if validation else self.cfg.rollout)
        return AgentSettings(max_turns=c.agent.max_turns, max_turn_length=c.agent.max_turn_length,
                             max_obs_length=c.agent.max_obs_length, max_response_length=c.rollout.max_response_length,
                             topk=c.agent.retrieval.topk, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                             routed_experts=c.actor.moe_routing_replay and not validation)

    def close(self) -> None:
        try:
            self.runtime.shutdown()
        finally:
            if self.tools is not None:  # their connections, on the driver loop's thread
                run_async(self.tools.aclose())
            if self.searcher is not None:
                run_async(self.searcher.aclose())


def build_components(cfg: RunConfig) -> Components:
    from transformers import AutoTokenizer

    check_model_files(cfg.model.path)  # here, in a second: not as a traceback from a worker after Ray started
    if cfg.critic.enable and cfg.critic.model_path:
        check_model_files(cfg.critic.model_path, key="critic.model_path")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    d = cfg.data
    train_records, dropped = load_prompts(d.train_files, tokenizer, prompt_key=d.prompt_key,
                                          max_prompt_length=d.max_prompt_length,
                                          apply_chat_template=d.apply_chat_template)
    val_records = []
    if d.val_files:
        val_records, _ = load_prompts(d.val_files, tokenizer, prompt_key=d.prompt_key,
                                      max_prompt_length=d.max_prompt_length, apply_chat_template=d.apply_chat_template)
    check_data_sources(cfg.reward, Counter(r.data_source for r in train_records + val_records))
    if cfg.agent.uses_search() and cfg.agent.retrieval.url is None:
        _warn_if_other_corpus(cfg.agent.retrieval.index_dir, d.train_files + d.val_files)
    steps_per_epoch = max(len(train_records) // d.train_batch_size, 1)
    total_steps = cfg.trainer.total_training_steps or steps_per_epoch * cfg.trainer.total_epochs
    runtime = build_runtime(cfg, total_steps)
    try:
        runtime.install_probe([r.prompt_ids for r in train_records])  # sync.probe: the engines checked from here on
    except BaseException:
        runtime.shutdown()
        raise
    searcher = None
    if cfg.agent.uses_search():
        r = cfg.agent.retrieval
        url = r.url or runtime.retrieval_url
        key = runtime.retrieval_api_key if r.url is None else r.api_key or os.environ.get(RETRIEVAL_KEY_ENV)
        log.info("retrieval server on %s%s", url, f" serving {r.index_dir}" if r.url is None else "")
        searcher = RetrievalClient(url, timeout_s=r.timeout_s, max_retries=r.max_retries, api_key=key)
        refused = searcher.check_access() if r.url is not None else None
        if refused:
            runtime.shutdown()
            raise ComponentDied(f"the retrieval server refuses megarl's requests ({refused}): give megarl the key it "
                                f"was started with (${RETRIEVAL_KEY_ENV} or agent.retrieval.api_key)")
    tools = None
    if cfg.agent.max_turns > 0:
        a = cfg.agent
        try:
            tools = build_toolset(a.tools, a.tool_format, tokenizer, searcher, a.retrieval.topk, runtime.tool_actors)
        except Exception:
            runtime.shutdown()
            raise
        log.info("agent tools: %s (%s format)", ", ".join(f"{n}{' (Ray actor)' if n in runtime.tool_actors else ''}"
                                                         for n in tools.tools), a.tool_format)
    return Components(cfg, tokenizer, train_records, val_records,
                      PromptOrder(len(train_records), cfg.trainer.seed, d.shuffle), runtime, searcher, tools,
                      total_steps, dropped)


def _warn_if_other_corpus(index_dir: str, data_files: list[str]) -> None:
    """A warning when the index megarl serves was built from another corpus than the data
    files record (megarl.retrieval.index.corpus_warnings; what it cannot see: docs/data.md)."""
    expected = {path: record for path in data_files if (record := data_corpus(path)) is not None}
    for warning in corpus_warnings(index_dir, expected):
        log.warning("megarl: warning: %s", warning)
