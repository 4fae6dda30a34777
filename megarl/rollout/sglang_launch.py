"""Starting and stopping the SGLang rollout fleet's processes (megarl.rollout.sglang).

Each engine is a server process (`python -m sglang.launch_server`, or megarl's embedded
engine behind the same API with `rollout.sglang.server=embedded`) kept by a `ServerProcess`
(a Ray actor, `ServerActor`) on the GPUs of its placement-group bundles; an engine across
nodes is one such process per node, kept together as an `EngineUnit`
(megarl.rollout.engine_unit). The router, when on, is one more process. Start-up waits for the
health check with a timeout and fails with the tail of the server's log. The servers and the router require one API key for the run (`fleet_api_key`),
handed to each process in its environment, never on its command line (SGLang and the router
read it through megarl.rollout.with_api_key). Main entry points: `launch_fleet`, `stop_fleet`,
`ServerProcess`, `server_command`, `router_command`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from megarl.config import RunConfig, SGLangConfig
from megarl.config_rollout import engine_nodes
from megarl.errors import ComponentDied
from megarl.http_auth import ENGINE_KEY_ENV, bearer, new_api_key
from megarl.rollout.engine_unit import EngineUnit
from megarl.rollout.sglang import SGLangFleet

log = logging.getLogger(__name__)


BIND_FAILED = b"address already in use"  # a server's log when a port it binds is taken (any case)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def with_api_key(python: str | None = None) -> list[str]:
    """The argv start that runs a module with --api-key from the environment (SGLang and the
    router read it nowhere else), under `python` (default: this interpreter)."""
    return [python or sys.executable, "-m", "megarl.rollout.with_api_key"]


# SGLang 0.5.23 on the CPU (cluster.gpus_per_node=0): its CPU engine (SGLANG_USE_CPU_ENGINE=1 in
# the server's environment) with torch's own attention; --sleep-on-idle keeps an idle scheduler
# from spinning a core. Its KV cache is sized in tokens, or it takes most of the machine's memory.
CPU_SERVER_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle"]
CPU_SERVER_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
CPU_KV_CACHE_TOKENS = 32768


def fleet_api_key(settings: SGLangConfig) -> str:
    """The run's key: rollout.sglang.api_key, else $MEGARL_ENGINE_API_KEY, else a fresh one."""
    return settings.api_key or os.environ.get(ENGINE_KEY_ENV) or new_api_key()


def server_command(cfg: RunConfig, colocated: bool) -> list[str]:
    """The argv of one engine server, without --host / --port (its actor adds them) and without
    its key (its actor puts that in the server's environment)."""
    r, s = cfg.rollout, cfg.rollout.sglang
    if s.server == "embedded":  # reads $MEGARL_ENGINE_API_KEY itself
        argv = [sys.executable, "-m", "megarl.rollout.serve", "--model-path", cfg.model.path, "--dtype",
                cfg.model.dtype, "--max-running-requests", str(min(r.max_concurrency, 256)),
                "--random-seed", str(cfg.trainer.seed)]
    else:
        argv = [*with_api_key(s.python), "sglang.launch_server", "--model-path", cfg.model.path,
                "--tp-size", str(r.tensor_parallel_size), "--dtype", cfg.model.dtype,
                "--mem-fraction-static", str(r.gpu_memory_utilization), "--random-seed", str(cfg.trainer.seed),
                "--max-running-requests", str(r.max_concurrency), "--log-level", "warning",
                "--weight-version", "0"]  # the checkpoint's tokens are version 0 (SGLang: "default")
        if not cfg.cluster.gpus_per_node:
            argv += CPU_SERVER_FLAGS + ["--max-total-tokens", str(s.max_total_tokens or CPU_KV_CACHE_TOKENS)]
        elif s.max_total_tokens:
            argv += ["--max-total-tokens", str(s.max_total_tokens)]
        if r.expert_parallel_size > 1:
            argv += ["--ep-size", str(r.expert_parallel_size)]
        if cfg.model.tokenizer_path:
            argv += ["--tokenizer-path", cfg.model.tokenizer_path]
        if cfg.model.trust_remote_code:
            argv.append("--trust-remote-code")
        if colocated:  # weights and KV cache can be released while the trainer runs
            argv.append("--enable-memory-saver")
        if cfg.sync_transport() == "lora":
            argv += lora_flags(cfg)
    if cfg.actor.moe_routing_replay:  # the experts of every token, for the trainer to replay
        argv.append("--enable-return-routed-experts")
    return argv + list(s.extra_args)


def lora_flags(cfg: RunConfig) -> list[str]:
    """SGLang's LoRA serving for actor.lora.sync=adapter: adapters up to the run's rank on the modules
    it trains, two loaded at once (the version served and the one replacing it during a sync), one a
    batch (every request is served with the newest); without a GPU, SGLang's torch-native LoRA
    backend (its default is a CUDA kernel)."""
    lora = cfg.actor.lora
    flags = ["--enable-lora", "--max-lora-rank", str(lora.r), "--lora-target-modules", *lora.modules(),
             "--max-loaded-loras", "2", "--max-loras-per-batch", "2"]
    return flags + ([] if cfg.cluster.gpus_per_node else ["--lora-backend", "torch_native"])


def router_command(settings: SGLangConfig, worker_urls: Sequence[str], metrics_port: int) -> list[str]:
    """The argv of sglang-router in front of `worker_urls`, without --host / --port. Given the
    workers' key (its --api-key, through with_api_key), sglang-router 0.3.2 requires it from
    clients and passes their Authorization header on to the workers.

    Its circuit breaker is off: the fleet finds dead and stalled engines itself and restarts them
    on their addresses (SGLangFleet._recover), and an open circuit kept an engine out for 60 s
    after that restart (in a CI run, every engine at once: each request answered 503 "no
    available workers" until its retries ran out)."""
    return [*with_api_key(), "sglang_router.launch_router", "--worker-urls", *worker_urls,
            "--policy", settings.router_policy, "--request-timeout-secs", str(int(settings.request_timeout_s)),
            "--worker-startup-timeout-secs", str(int(settings.startup_timeout_s)), "--disable-circuit-breaker",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), "--log-level", "warn"]


# the trainer's process settings a server must not inherit: an allocator setting of the
# trainer (expandable segments, say) changes how SGLang's memory saver maps and releases memory
TRAINER_ONLY_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def server_env(inherited: Mapping[str, str], own: Mapping[str, str]) -> dict[str, str]:
    """A server process's environment: what it inherits, less TRAINER_ONLY_ENV, plus its own
    settings (which may set those again on purpose)."""
    return {**{k: v for k, v in inherited.items() if k not in TRAINER_ONLY_ENV}, **own}


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the launching process dies (Linux), so a
    server never outlives its Ray actor."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    """One server process: launched with --host / --port appended, its output in a log file,
    ready once `health_route` answers 200 (with None, once launched). Restarts keep the address, so the router's worker
    list stays valid. Stopped through its own process group only (nothing is killed by name).
    host None = this node's address (multi-node runs). `api_key`: the server's key, in its
    environment as $MEGARL_ENGINE_API_KEY (never in its argv or the log).
    In Ray it runs as `ServerActor` on the node (and GPUs) of its bundle."""

    def __init__(self, argv: Sequence[str], name: str, *, host: str | None = "127.0.0.1", port: int = 0,
                 log_dir: str | None = None, env: dict[str, str] | None = None, health_route: str | None = "/health",
                 api_key: str | None = None):
        self.argv, self.name, self.health_route, self.api_key = list(argv), name, health_route, api_key
        self.host = host or _node_address()
        self.port_chosen = not port  # a port picked here may be lost to a race (see start)
        self.port = port or free_port(self.host)
        self.url = f"http://{self.host}:{self.port}"
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="megarl-servers-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self.env = dict(env or {})
        self.launch_args: list[str] = []
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self.start_offset = self.log_read = 0
        self.ever_ready = False  # once a server answered, its address is in the router's list

    def start(self, timeout_s: float = 900.0, launch_args: Sequence[str] | None = None) -> str:
        """Launch and wait until healthy; the URL, or RuntimeError with the tail of the log.
        `launch_args`: arguments of this start and the next ones (an engine's node rank and
        meeting address, megarl.rollout.engine_unit.rank_args), after the argv."""
        if self.alive():
            return self.url
        if launch_args is not None:
            self.launch_args = list(launch_args)
        self.starts += 1
        argv = [*self.argv, *self.launch_args]
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== megarl: start {self.starts} of {self.name}: {' '.join(argv)}\n".encode())
            out.flush()
            self.start_offset = self.log_read = out.tell()  # where this start's own lines begin
            env = server_env(os.environ, self.env)
            env.pop(ENGINE_KEY_ENV, None)  # the server's own key, or none
            if self.api_key:
                env[ENGINE_KEY_ENV] = self.api_key
            if self.launch_args and "SGLANG_HOST_IP" not in self.env:
                # the address an engine's other nodes reach this rank at (SGLang's broadcast queue
                # between nodes); else SGLang guesses it from a route to the internet or the hostname
                env["SGLANG_HOST_IP"] = self.address()
            self.process = subprocess.Popen([*argv, "--host", self.host, "--port", str(self.port)],
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=_die_with_parent, env=env)
        if self.health_route is None:  # nothing of its own to ask: started once launched
            return self.url
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            # a lost bind does not always end the process: SGLang's HTTP server gives up on its
            # port while the scheduler it started lives on, and would be waited for till the deadline
            lost_bind = self._bind_failed()
            if lost_bind and code is None:
                try:
                    code = self.process.wait(timeout=2.0)  # most exit on their own
                except subprocess.TimeoutExpired:
                    self.stop()
            if lost_bind and self._may_move():
                # another process bound the free port first (servers on one node pick theirs
                # at once): the first start moves to a new one; a restart keeps the router's address
                log.warning("%s: port %d was taken before the server bound it; starting on another",
                            self.name, self.port)
                self.port = free_port(self.host)
                self.url = f"http://{self.host}:{self.port}"
                return self.start(max(deadline - time.monotonic(), 1.0))
            if code is not None or lost_bind:
                how = f"exited with status {code}" if code is not None else "could not bind its port"
                raise RuntimeError(f"{self.name} {how} while starting; the end of "
                                   f"{self.log_path}:\n{self.log_tail()}")
            try:
                answer = httpx.get(self.url + self.health_route, headers=bearer(self.api_key), timeout=5.0)
                if answer.status_code == 200:
                    self.ever_ready = True
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer {self.health_route} within {timeout_s:.0f} s "
                           f"(rollout.sglang.startup_timeout_s); the end of {self.log_path}:\n{self.log_tail()}")

    def _bind_failed(self) -> bool:
        """This start's log says an address was in use (the port asked for, or one of the
        server's own: either way this start will not serve). Reads only what the log gained
        since the last look, and the phrase's length before it."""
        try:
            with open(self.log_path, "rb") as log_file:
                log_file.seek(max(self.start_offset, self.log_read - len(BIND_FAILED)))
                seen = log_file.read()
                self.log_read = log_file.tell()
                return BIND_FAILED in seen.lower()
        except OSError:
            return False

    def _may_move(self) -> bool:
        return self.port_chosen and self.starts <= 3 and not self.ever_ready

    def restart(self, timeout_s: float = 900.0) -> str:
        self.stop()
        return self.start(timeout_s)

    def address(self) -> str:
        """This server's address as other nodes reach it: its bind address, or its node's where
        it binds to every interface."""
        return self.host if self.host not in ("0.0.0.0", "::") else _node_address()

    def meeting_address(self) -> str:
        """host:port where the node ranks of an engine meet (SGLang --dist-init-addr): a port free
        now on this server's address."""
        return f"{self.address()}:{free_port(self.address())}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def gone_within(self, seconds: float) -> bool:
        """Whether the process has exited, or exits within `seconds`: a killed server's
        connections can break before its process can be reaped (its threads still exiting)."""
        if self.process is None:
            return True
        try:
            self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)  # the server and the workers it forked
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=grace_s)
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"


def _node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _bundle_device():
    """(node address, GPU ids) of the placement-group bundle this task runs in."""
    import ray

    return ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]


def launch_fleet(cfg: RunConfig, placement_group, engine_bundles: list[list[int]], router_bundle: int,
                 log_dir: str, weight_dir: str) -> SGLangFleet:
    """Start each engine's servers on its bundles (one per node it spans, each seeing exactly
    its GPUs there; see megarl.rollout.engine_unit), then the router, and return the fleet.
    `engine_bundles[e]` lists the bundle indices whose GPUs engine e uses, in TP order (shared
    with train ranks when colocated); on the CPU, one bundle per node rank."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def place(i):
        return PlacementGroupSchedulingStrategy(placement_group=placement_group, placement_group_bundle_index=i)

    s, gpus = cfg.rollout.sglang, cfg.cluster.gpus_per_node > 0
    colocated = gpus and cfg.rollout.mode == "colocated"
    api_key = fleet_api_key(s)
    host = s.host or ("127.0.0.1" if cfg.cluster.nnodes == 1 else None)
    probe = ray.remote(_bundle_device)
    devices = {i: ray.get(probe.options(num_cpus=0, num_gpus=0.01 if gpus else 0, scheduling_strategy=place(i)).remote())
               for bundles in engine_bundles for i in bundles}
    server_actor = ray.remote(ServerProcess)
    argv = server_command(cfg, colocated)
    units, entries, nodes = [], [], engine_nodes(cfg)
    spread = _nodes_in_turn() if not gpus and nodes > 1 else None
    for e, bundles in enumerate(engine_bundles):
        actors, rank_nodes = [], []
        ranks = node_ranks(e, bundles, devices, nodes, gpus)
        for n, rank_bundles in enumerate(ranks):
            engine_gpus = [g for i in rank_bundles for g in devices[i][1]]  # TP rank i runs on the i-th
            env = {"CUDA_VISIBLE_DEVICES": ",".join(engine_gpus)} if gpus else cpu_server_env(len(ranks))
            name = f"engine{e}" if len(ranks) == 1 else f"engine{e}-node{n}"
            where, node = place(rank_bundles[0]), devices[rank_bundles[0]][0]
            if spread:  # a CPU engine's ranks on different nodes, as far as there are nodes
                node, where = spread[(e * len(ranks) + n) % len(spread)]
            # node rank n > 0 is ready when node rank 0 is (SGLang's API waits for every rank);
            # the health server SGLang gives it may lose its port to the rank's own sockets
            actors.append(server_actor.options(num_cpus=0, num_gpus=(0.2 if colocated else 1) if gpus else 0,
                                               scheduling_strategy=where).remote(
                argv, name, host=host, log_dir=log_dir, env=env, api_key=api_key,
                health_route=None if n else "/health"))
            rank_nodes += [devices[i][0] for i in rank_bundles] if gpus else [node]
        units.append(EngineUnit(actors))
        entries.append((f"engine{e}", units[-1], cfg.rollout.tensor_parallel_size, rank_nodes[0],
                        [g for i in bundles for g in devices[i][1]], rank_nodes))
    urls = _start_all(units, [f"rollout engine {e}" for e in range(len(units))], s.startup_timeout_s)
    router = None
    if s.router:
        actor = server_actor.options(num_cpus=0, scheduling_strategy=place(router_bundle)).remote(
            router_command(s, urls, free_port()), "router", host=host, log_dir=log_dir, api_key=api_key)
        router = (actor, _start_all([EngineUnit([actor])], ["sglang-router"], s.startup_timeout_s)[0])
    fleet = SGLangFleet([(name, unit, url, tp, node, engine_gpus, rank_nodes)
                         for (name, unit, tp, node, engine_gpus, rank_nodes), url in zip(entries, urls)], s,
                        router=router, weight_dir=weight_dir, liveness=cfg.cluster.liveness, api_key=api_key)
    log.info("rollout fleet: %d %s engines (TP %d on %d node(s) each) at %s%s", len(urls), s.server,
             cfg.rollout.tensor_parallel_size, nodes, urls, f", router at {router[1]}" if router else "")
    return fleet


def node_ranks(engine: int, bundles: Sequence[int], devices: Mapping[int, tuple[str, list[str]]], nodes: int,
               gpus: bool) -> list[list[int]]:
    """The bundles of each node rank of an engine, node rank 0 first. On GPUs the engine's
    bundles (in TP order) must fill `nodes` nodes evenly, in order; on the CPU each bundle is
    one node rank (two may share a machine: SGLang's ranks meet over TCP all the same)."""
    if not gpus:
        return [[i] for i in bundles]
    per_node = len(bundles) // nodes
    ranks = [list(bundles[n * per_node:(n + 1) * per_node]) for n in range(nodes)]
    where = [sorted({devices[i][0] for i in rank}) for rank in ranks]
    if any(len(w) > 1 for w in where) or len({w[0] for w in where}) < nodes:
        raise RuntimeError(f"rollout engine {engine}'s {len(bundles)} GPUs landed on {[w for w in where]}: each of "
                           f"its {nodes} node(s) must hold {per_node} of them, in TP order "
                           "(rollout.tensor_parallel_size, rollout.nodes_per_engine; cluster.placement_strategy=PACK "
                           "keeps a node's GPUs together)")
    return ranks


def _nodes_in_turn() -> list[tuple[str, object]]:
    """(address, scheduling strategy) of each alive Ray node, by address. On the CPU a server
    reserves no core (its bundle is bookkeeping), so the node ranks of an engine are pinned to
    nodes in turn: bundles of one CPU each may share a node, where SGLang's ranks would not."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = sorted((n["NodeManagerAddress"], n["NodeID"]) for n in ray.nodes() if n["Alive"])
    return [(address, NodeAffinitySchedulingStrategy(node_id, soft=False)) for address, node_id in alive]


def cpu_server_env(nodes: int) -> dict[str, str]:
    """A CPU server's environment: SGLang's CPU engine; for an engine over several nodes, each
    rank's threads on all of its machine's cores (SGLang otherwise wants a NUMA node per rank)."""
    env = dict(CPU_SERVER_ENV)
    if nodes > 1:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join([f"0-{(os.cpu_count() or 1) - 1}"] * nodes)
    return env


def _start_all(units: list[EngineUnit], names: list[str], timeout_s: float) -> list[str]:
    import ray

    async def start_all():
        return await asyncio.gather(*[unit.start(timeout_s) for unit in units], return_exceptions=True)

    urls = []
    for name, url in zip(names, asyncio.run(start_all())):
        if isinstance(url, ray.exceptions.RayError):
            raise ComponentDied(f"{name} failed to start: {url}") from None
        if isinstance(url, BaseException):
            raise url
        urls.append(url)
    return urls


def stop_fleet(fleet: SGLangFleet, unreachable: list = ()) -> None:
    """Stop the router and every server (each through its own process group), then the actors.
    The actors in `unreachable` (they did not answer after a failure) are not asked: Ray stops
    them, and a server whose launcher is gone stops with it."""
    import ray

    first = ([fleet.router_actor] if fleet.router_actor is not None else []) + [s.unit.actors[0] for s in fleet.servers]
    rest = [a for s in fleet.servers for a in s.unit.actors[1:]]
    # node rank 0 first: its shutdown stops the schedulers of an engine's other nodes
    for group in (first, rest):
        try:
            ray.get([a.stop.remote() for a in group if not any(a is u for u in unreachable)], timeout=60)
        except (ray.exceptions.RayError, TimeoutError) as e:  # an actor already gone took its server with it
            log.debug("fleet stop: %s", e)
    actors = first + rest
    for actor in actors:
        ray.kill(actor)
