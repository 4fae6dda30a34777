"""The `rollout` section of a run's configuration (megarl.config): the engines (embedded, or a
fleet of SGLang servers), their sampling, and the checks of both against the rest of the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.config_loader import Problems, param


@dataclass
class SamplingConfig:
    """How responses are sampled; the defaults are the training rollouts' (rollout.*),
    validation sets its own (rollout.val.*)."""

    temperature: float = param(1.0, "Sampling temperature; 0 = greedy.", ge=0.0)
    top_p: float = param(1.0, "Nucleus sampling mass.", gt=0.0, le=1.0)
    top_k: int = param(-1, "Top-k sampling; -1 = off.", ge=-1)
    n: int = param(16, "Samples per prompt (in training, the GRPO group size).", gt=0)


@dataclass
class SGLangConfig:
    server: Literal["sglang", "embedded"] = param(
        "sglang", "Server each engine runs: sglang = `python -m sglang.launch_server`; embedded = megarl's engine "
        "behind the same HTTP API (`python -m megarl.rollout.serve`: CPU runs, tests of the fleet).")
    router: bool = param(True, "Put sglang-router (cache-aware routing) in front of the engines; off = megarl "
                         "sends each request to the engine with the fewest in flight.")
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = param(
        "cache_aware", "sglang-router's routing policy.")
    host: str | None = param(None, "Address servers and router bind to; None = 127.0.0.1 on a one-node run, the "
                             "node's own address when cluster.nnodes > 1.")
    api_key: str | None = param(
        None, "Key every engine server and the router require on all routes but the health checks (SGLang's "
        "--api-key: 'Authorization: Bearer KEY'); None = $MEGARL_ENGINE_API_KEY if set, else a fresh random key "
        "for each run. Never in the saved config, MLflow, logs or a server's command line; the environment "
        "variable keeps it out of your config files too.", secret=True)
    startup_timeout_s: float = param(900.0, "Seconds a server (or the router) may take to answer its health check "
                                     "after launch before the run stops with the tail of its log; also how long a request waits while "
                                     "sglang-router answers that it has no engine to send to.", gt=0.0)
    health_timeout_s: float = param(60.0, "Seconds one health check (/health_generate) may take.", gt=0.0)
    request_timeout_s: float = param(3600.0, "Seconds one generate request may take.", gt=0.0)
    max_request_retries: int = param(3, "Times a request that failed on a dead or erroring engine is re-sent "
                                     "(after the dead engine is restarted) before the run stops.", ge=0)
    max_restarts: int = param(3, "Restarts allowed per engine over the run before it counts as dead for good.", ge=0)
    python: str | None = param(
        None, "Python interpreter that runs the SGLang servers, for SGLang installed in an environment of its own "
        "(`make sglang-env` builds .venv-sglang, SGLang for the CPU); None = the run's own interpreter. megarl must "
        "be importable there too (`pip install --no-deps -e .`): the servers start through megarl.rollout.with_api_key.")
    max_total_tokens: int | None = param(
        None, "Tokens of KV cache per SGLang server (--max-total-tokens); None = what "
        "rollout.gpu_memory_utilization leaves on a GPU, and 32768 on the CPU (cluster.gpus_per_node=0), where SGLang "
        "would otherwise take most of the machine's memory.", gt=0)
    extra_args: list[str] = param(help="More command-line flags for every server, e.g. "
                                  "['--attention-backend', 'fa3'].", factory=list)


@dataclass
class RolloutConfig(SamplingConfig):
    """Generation engines, and the sampling of training rollouts (temperature, top_p, top_k, n)."""

    engine: Literal["local", "sglang"] = param("local", "local = embedded in-process engine; sglang = a fleet of "
                                               "engine servers (rollout.sglang) launched by Ray.")
    max_response_length: int = param(20480, "Longest response in tokens (all turns of a trajectory together).", gt=0)
    tensor_parallel_size: int = param(1, "GPUs per rollout engine (SGLang --tp); more than a node's GPUs makes "
                                      "an engine span several nodes (rollout.nodes_per_engine).", gt=0)
    nodes_per_engine: int | None = param(
        None, "Nodes one engine spans (SGLang --nnodes): None = as many as its TP needs (tensor_parallel_size / "
        "cluster.gpus_per_node, at least 1). On the CPU (cluster.gpus_per_node=0) each node holds one TP rank of "
        "SGLang's server, so tensor_parallel_size must equal it.", gt=0)
    expert_parallel_size: int = param(
        1, "Expert parallelism inside each engine, a mixture of experts' experts split over its GPUs (SGLang "
        "--ep-size; divides tensor_parallel_size).", gt=0)
    num_engines: int | None = param(None, "Rollout engines; None = as many as the rollout GPUs allow.", gt=0)
    mode: Literal["colocated", "disaggregated"] = param(
        "colocated", "colocated = engines share the trainer's GPUs; disaggregated = engines on their own GPUs."
    )
    gpu_memory_utilization: float = param(0.6, "SGLang's mem_fraction_static: the fraction of the memory free when the engine starts that its weights and KV cache may take (`megarl plan` proposes it).", gt=0.0, le=1.0)
    max_concurrency: int = param(1024, "Requests in flight per engine.", gt=0)
    kv_cache_tokens: int | None = param(
        None, "The embedded engine's K/V cache in positions, all its sequences together (running, and finished ones "
        "kept for prefix reuse); None = what a quarter of the memory available when it starts holds. It admits a "
        "request while the positions its prompt and max_new_tokens may reach fit, and grows the cache as sequences "
        "grow, so memory follows use, not max_concurrency (SGLang sizes its pool by rollout.gpu_memory_utilization).",
        gt=0)
    sglang: SGLangConfig = param(help="The engine-server fleet (rollout.engine=sglang).", factory=SGLangConfig)
    val: SamplingConfig = param(
        help="Sampling for validation (DAPO's AIME protocol: 32 samples at top_p 0.7 for avg@32).",
        factory=lambda: SamplingConfig(temperature=1.0, top_p=0.7, top_k=-1, n=32),
    )


def check_rollout(cfg, problems: Problems) -> None:
    """The rules of rollout.* and the weight transport that involve the rest of the run (`cfg`, a RunConfig)."""
    from megarl.weights import TRANSPORTS, transport_class  # a small table; a transport's module on use

    r, c, transport = cfg.rollout, cfg.cluster, cfg.sync_transport()
    if transport not in TRANSPORTS:
        problems.add("sync.transport", f"{transport!r} is not a weight transport",
                     f"use auto or one of {sorted(TRANSPORTS)}")
    else:
        transport_class(transport).check(cfg, problems)
    if r.engine == "local":
        return
    if cfg.launcher() != "ray":
        problems.add("cluster.launcher", "inprocess cannot launch engine servers", "use cluster.launcher=ray or auto")
    if any(a.split("=")[0] in ("--api-key", "--admin-api-key") for a in r.sglang.extra_args):
        problems.add("rollout.sglang.extra_args", "gives the servers an API key on their command line, where "
                     "every user of the node can read it (and the saved config records it)",
                     "remove it: megarl gives the servers and the router a key of its own, or set "
                     "$MEGARL_ENGINE_API_KEY (or rollout.sglang.api_key)")
    check_engine_nodes(cfg, problems)
    if c.gpus_per_node == 0:
        return
    if r.tensor_parallel_size % r.expert_parallel_size:
        problems.add("rollout.expert_parallel_size", f"{r.expert_parallel_size} does not divide the engine's "
                     f"{r.tensor_parallel_size} GPUs (rollout.tensor_parallel_size)",
                     "SGLang splits the experts over the GPUs of one engine: choose a divisor of its TP")
    if r.mode == "colocated" and cfg.train_world_size() % r.tensor_parallel_size:
        problems.add("rollout.tensor_parallel_size", f"{r.tensor_parallel_size} does not divide the "
                     f"{cfg.train_world_size()} train GPUs the engines share (rollout.mode=colocated)",
                     "choose an engine TP that divides the number of GPUs")
    if r.mode == "colocated" and cfg.num_rollout_engines() * r.tensor_parallel_size > cfg.train_world_size():
        problems.add("rollout.num_engines", f"{cfg.num_rollout_engines()} engines x TP {r.tensor_parallel_size} "
                     f"need more GPUs than the {cfg.train_world_size()} train GPUs they share",
                     "lower rollout.num_engines or leave it null")
    if r.mode == "disaggregated" and cfg.num_rollout_engines() < 1:
        problems.add("rollout.mode", f"disaggregated engines need GPUs of their own, but the trainer takes all "
                     f"{c.nnodes * c.gpus_per_node}", "set actor.parallel.data_parallel_size lower, or "
                     "rollout.mode=colocated")


def engine_nodes(cfg) -> int:
    """The nodes one engine spans (rollout.nodes_per_engine, or as many as its TP needs)."""
    r, gpus = cfg.rollout, cfg.cluster.gpus_per_node
    if r.nodes_per_engine is not None:
        return r.nodes_per_engine
    return -(-r.tensor_parallel_size // gpus) if gpus else 1


def check_engine_nodes(cfg, problems: Problems) -> None:
    """An engine across nodes: SGLang's server (the embedded one is one process), an equal share
    of its TP ranks on each node, and the nodes to hold it."""
    r, c, nodes = cfg.rollout, cfg.cluster, engine_nodes(cfg)
    tp = r.tensor_parallel_size
    if nodes > 1 and r.sglang.server == "embedded":
        problems.add("rollout.nodes_per_engine", f"{nodes} nodes per engine: megarl's embedded server runs an "
                     "engine in one process", "use rollout.sglang.server=sglang for engines across nodes")
    if not c.gpus_per_node:
        if r.sglang.server == "sglang" and tp != nodes:
            problems.add("rollout.tensor_parallel_size", f"{tp} TP ranks on {nodes} node(s): SGLang's CPU engine "
                         "(cluster.gpus_per_node=0) runs one TP rank per node", f"set rollout.nodes_per_engine={tp}")
        return
    if tp % nodes or tp // nodes > c.gpus_per_node or (nodes > 1 and tp != nodes * c.gpus_per_node):
        key = "rollout.tensor_parallel_size" if r.nodes_per_engine is None else "rollout.nodes_per_engine"
        problems.add(key, f"an engine of {tp} GPUs on {nodes} node(s) of {c.gpus_per_node} GPUs does not fill them "
                     "(an engine across nodes takes whole nodes)", f"choose rollout.tensor_parallel_size up to "
                     f"{c.gpus_per_node}, or a multiple of it, and leave rollout.nodes_per_engine null")
    if nodes > c.nnodes:
        problems.add("rollout.tensor_parallel_size", f"an engine of {tp} GPUs spans {nodes} nodes, more than "
                     f"cluster.nnodes={c.nnodes}", "lower the engine's TP or add nodes")
