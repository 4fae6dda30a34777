"""The run as Ray actors in one placement group (cluster.launcher=ray).

On one machine Ray starts locally, on loopback only (megarl.runtime.local_ray); with
`cluster.ray_address=auto` (the slurm recipes) the same code joins a multi-node cluster.
The train ranks, the engine (the embedded one in an actor, or the SGLang fleet's servers),
the retrieval server and the reward workers are actors (megarl.runtime.ray_actors), reached
through proxies with the in-process interfaces (megarl.runtime.ray_proxies). Weights go from
the rank actors to the engines directly, never through the driver. Main entry points:
`RayRuntime`, `placement_bundles`.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl.config import RunConfig
from megarl.config_rollout import engine_nodes
from megarl.driver_loop import run_async
from megarl.errors import ComponentDied
from megarl.rollout.sglang_api import MEMORY_TAGS
from megarl.runtime.base import Runtime, hosted_retrieval_key, within
from megarl.runtime.local_ray import init_local_ray
from megarl.runtime.ray_actors import EngineActor, TrainWorkerActor, sharers
from megarl.runtime.service_actors import RetrievalActor, RewardActor, SandboxActor, ToolActor
from megarl.runtime.liveness import died, frozen, wait_started
from megarl.runtime.ray_proxies import RayRanks, RemoteEngine, RemoteRewardPool, RemoteTrainWorker, rank_name
from megarl.termination import handlers_kept
from megarl.weights import transport_class

log = logging.getLogger(__name__)


class RayRuntime(Runtime):
    """Starts (or joins) Ray, reserves a placement group, and creates the actors.

    Bundles, packed onto as few nodes as possible (cluster.placement_strategy): each train rank (one with the torch
    backend, TP x PP x CP x DP with megatron) and the engine get one each ({"CPU": 1}, plus
    {"GPU": 1} when cluster.gpus_per_node > 0); the retrieval server and the reward actor
    share a {"CPU": 1} bundle. A local Ray is started with at least as many logical CPUs
    (scheduling slots, not cores) as bundles, so a 2-core machine runs it all.
    """

    retrieval_where = " (Ray actor RetrievalActor)"

    def __init__(self, cfg: RunConfig, total_steps: int):
        self.cfg = cfg
        self._started_ray = False
        if not ray.is_initialized():
            c = cfg.cluster
            with handlers_kept():  # ray.init makes SIGTERM sys.exit(15); the run's stop (megarl.termination) stays
                if c.ray_address:
                    ray.init(address=c.ray_address, log_to_driver=True)
                else:
                    init_local_ray(num_cpus=c.cpus_per_node or max(len(placement_bundles(cfg)[0])
                                                                   + cfg.reward.sandbox_servers, os.cpu_count() or 2),
                                   num_gpus=c.gpus_per_node, include_dashboard=False, log_to_driver=True)
            self._started_ray = True
        self.pg, self.worker_actors, self.engine_actor, self.reward_actor, self.retrieval_actor = None, [], None, None, None
        self.sandbox_actors = []  # reward.sandbox_servers
        self.tool_actors: dict = {}  # agent tools with ray: true, by name
        self.parts = []  # (kind, name, actor, node address), once all are started
        self.silent: list = []  # (name, actor) of the parts that did not answer lost_parts' question
        self.hostnames: dict[str, str] = {}  # node address -> its hostname
        self.fleet, self.transport, self.engine, self.reward_pool = None, None, None, None
        gpus = cfg.cluster.gpus_per_node > 0
        self.colocated = cfg.rollout.engine == "sglang" and gpus and cfg.rollout.mode == "colocated"
        try:
            self._start(cfg, total_steps)
        except BaseException:
            self.shutdown()  # nothing left behind by a start that failed half-way
            raise

    def _start(self, cfg: RunConfig, total_steps: int) -> None:
        world, gpus = cfg.train_world_size(), 1 if cfg.cluster.gpus_per_node else 0
        bundles, engine_bundles = placement_bundles(cfg)
        misc = len(bundles) - 1
        self.pg = placement_group(bundles, strategy=cfg.cluster.placement_strategy, name="megarl")
        ready, _ = ray.wait([self.pg.ready()], timeout=120)
        if not ready:
            raise RuntimeError(f"Ray could not reserve {bundles} within 120 s; available: "
                               f"{ray.available_resources()} — add resources or lower the request")
        place = [PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i)
                 for i in range(len(bundles))]
        train_gpus = 0.8 if self.colocated else gpus  # a colocated engine server takes the other 0.2
        self.worker_actors = [TrainWorkerActor.options(num_cpus=1, num_gpus=train_gpus, scheduling_strategy=place[r])
                              .remote() for r in range(world)]
        reward, env = self._start_sandboxes(cfg)
        self.reward_actor = RewardActor.options(num_cpus=0.5, scheduling_strategy=place[misc]).remote(
            reward, cfg.reward.num_workers, cfg.reward.timeout_s, env)
        if cfg.agent.uses_search() and cfg.agent.retrieval.url is None:
            self.retrieval_api_key = hosted_retrieval_key(cfg.agent.retrieval)
            self.retrieval_actor = RetrievalActor.options(num_cpus=0.5, scheduling_strategy=place[misc]).remote(
                cfg.agent.retrieval, self.retrieval_api_key, cfg.cluster.nnodes)
        if cfg.agent.max_turns > 0:
            self.tool_actors = {name: ToolActor.options(num_cpus=spec.get("num_cpus", 0)).remote(name, spec)
                                for name, spec in cfg.agent.tools.items() if spec.get("ray")}
        liveness = cfg.cluster.liveness
        # started (imports, CUDA) within startup_timeout_s before any call into them is watched by
        # pings: a rank still in its constructor cannot answer one, and is not frozen
        wait_started(self.worker_actors, [rank_name(r) for r in range(world)], liveness)
        self.ranks = RayRanks(self.worker_actors, liveness)
        master = self.ranks.free_address(0)
        # the CPU threads of each model's actor: its node's cores shared by what computes at once
        sharing = sharers(placement_group_table(self.pg)["bundles_to_node_id"], world,
                          cfg.trainer.async_rollout.enable and cfg.rollout.engine != "sglang")
        has_reference = self.ranks.gather([a.setup.remote(cfg, total_steps, r, world, master, sharing[r])
                                           for r, a in enumerate(self.worker_actors)])[0]
        self.worker = RemoteTrainWorker(self.worker_actors, has_reference, liveness, mini_rows={
            "actor": cfg.actor.ppo_mini_batch_size * cfg.rollout.n, "critic": cfg.critic.ppo_mini_batch_size * cfg.rollout.n})
        if self.colocated and cfg.trainer_sleeps():
            # asleep before the engines start: SGLang sizes its KV cache from the memory free then
            self._sleep_trainer()
        if cfg.rollout.engine == "sglang":
            from megarl.rollout.sglang_launch import launch_fleet
            from megarl.weights.disk import weight_dir

            out = Path(cfg.trainer.output_dir).resolve()
            self.fleet = self.engine = launch_fleet(cfg, self.pg, engine_bundles, misc, str(out / "logs"),
                                                    str(weight_dir(cfg)))
        else:
            self.engine_actor = EngineActor.options(num_cpus=1, num_gpus=gpus, scheduling_strategy=place[world],
                                                    max_concurrency=1000).remote(cfg, sharing[world])
            self.engine = RemoteEngine(self.engine_actor, liveness)
        self.transport = transport_class(cfg.sync_transport())(cfg, self.engine)
        self.reward_pool = RemoteRewardPool(self.reward_actor, liveness)
        actors, names = [self.reward_actor], [RemoteRewardPool.NAME]
        if self.engine_actor is not None:
            actors.append(self.engine_actor)
            names.append(RemoteEngine.NAME)
        actors += list(self.tool_actors.values())
        names += [f"agent tool {name} (Ray actor ToolActor)" for name in self.tool_actors]
        wait_started(actors, names, liveness)  # before any call into them is watched
        if self.retrieval_actor is not None:
            name = f"retrieval server (Ray actor RetrievalActor serving {cfg.agent.retrieval.index_dir})"
            try:  # its constructor loads the index
                self.retrieval_url = ray.get(self.retrieval_actor.url.remote(), timeout=liveness.startup_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise ComponentDied(f"{name} did not start within {liveness.startup_timeout_s:.0f} s "
                                    "(cluster.liveness.startup_timeout_s)") from None
            except ray.exceptions.RayActorError as e:
                raise died(name, e) from e
        self.parts = self._locate_parts()
        print(f"megarl placement: {self.placement()}", file=sys.stderr, flush=True)  # where to find each part's logs

    def _start_sandboxes(self, cfg: RunConfig):
        """reward.sandbox_servers sandbox services, spread over the nodes with a CPU each; the
        reward settings that send the code rewards to them, and their key for the reward workers."""
        r = cfg.reward
        if not r.sandbox_servers:
            return r, {}
        from dataclasses import replace

        from megarl.http_auth import new_api_key
        from megarl.reward.sandbox_service import SANDBOX_KEY_ENV

        key = new_api_key()
        self.sandbox_actors = [SandboxActor.options(num_cpus=1, scheduling_strategy="SPREAD").remote(
            key, cfg.cluster.nnodes, r.code_wall_s, r.code_memory_mb) for _ in range(r.sandbox_servers)]
        try:
            urls = ray.get([a.url.remote() for a in self.sandbox_actors], timeout=cfg.cluster.liveness.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ComponentDied(f"the {r.sandbox_servers} sandbox services (Ray actors SandboxActor) did not start "
                                f"within {cfg.cluster.liveness.startup_timeout_s:.0f} s") from None
        except ray.exceptions.RayActorError as e:
            raise died("sandbox service (Ray actor SandboxActor)", e) from e
        return replace(r, code_sandbox_url=",".join(urls)), {SANDBOX_KEY_ENV: key}

    def _locate_parts(self) -> list[tuple[str, str, object, str]]:
        """(kind, name, Ray actor, node address) of each part of the run."""
        parts = [("train ranks", f"train rank {r}", a) for r, a in enumerate(self.worker_actors)]
        parts += [(kind, kind, a) for kind, a in (("rollout engine", self.engine_actor),
                                                  ("reward workers", self.reward_actor),
                                                  ("retrieval server", self.retrieval_actor)) if a is not None]
        parts += [("sandbox services", f"sandbox service {i}", a) for i, a in enumerate(self.sandbox_actors)]
        parts += [("agent tools", f"agent tool {name}", a) for name, a in self.tool_actors.items()]
        if self.fleet is not None:
            parts += [("rollout engines", f"rollout {s.name}" + (f" (node rank {n})" if n else ""), a)
                      for s in self.fleet.servers for n, a in enumerate(s.unit.actors)]
            if self.fleet.router_actor is not None:
                parts.append(("sglang-router", "sglang-router", self.fleet.router_actor))
        refs = [a.__ray_call__.remote(lambda _: (ray.util.get_node_ip_address(), socket.gethostname())) for _, _, a in parts]
        nodes = ray.get(refs, timeout=self.cfg.cluster.liveness.timeout_s)
        self.hostnames = dict(nodes)
        located = [(kind, name, actor, node) for (kind, name, actor), (node, _) in zip(parts, nodes)]
        # named with their node in errors; a push's engines watched while it is pending
        where = [f"node {self.hostnames[node]} ({node})" for *_, node in located]  # the ranks first
        self.ranks.nodes = self.worker.nodes = dict(enumerate(where[:len(self.worker_actors)]))
        self.ranks.engines = [(actor, f"{name} (Ray actor) on {at}") for (kind, name, actor, _), at in zip(located, where)
                              if kind in ("rollout engine", "rollout engines")]
        return located

    def placement(self) -> str:
        """Which node (address) each kind of part runs on, in one line; the retrieval server with
        the URL it serves at."""
        kinds: dict[str, set[str]] = {}
        for kind, _, _, node in self.parts:
            kinds.setdefault(kind, set()).add(node)
        at = {"retrieval server": f" at {self.retrieval_url}"} if self.retrieval_actor is not None else {}
        return "; ".join(f"{kind} on {', '.join(sorted(nodes))}{at.get(kind, '')}" for kind, nodes in kinds.items())

    def lost_parts(self) -> str:
        """After a part failed: the parts whose Ray actors are gone, by node, each node with its
        hostname and whether Ray has marked it dead; "" when none is gone. A part that does not
        answer within a few seconds (busy, or its node unreachable but not yet declared dead) is
        not counted: only Ray's own verdict that an actor is gone is."""
        refs = [a.__ray_call__.remote(lambda _: None) for _, _, a, _ in self.parts]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(10.0, self.cfg.cluster.liveness.timeout_s))
        self.silent = [(name, a) for (_, name, a, _), ref in zip(self.parts, refs) if ref not in ready]
        gone: dict[str, list[str]] = {}
        for (_, name, _, node), ref in zip(self.parts, refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    gone.setdefault(node, []).append(name)
        if not gone:
            return ""
        hosts, alive = dict(self.hostnames), set()
        for n in ray.nodes():
            hosts[n["NodeManagerAddress"]] = n.get("NodeManagerHostname", "") or hosts.get(n["NodeManagerAddress"], "")
            if n["Alive"]:
                alive.add(n["NodeManagerAddress"])
        return "; ".join(f"gone on node {hosts.get(node) or '?'} ({node}"
                         f"{'' if node in alive else ', which Ray has marked dead'}): {', '.join(names)}"
                         for node, names in gone.items())

    def check_retrieval(self) -> None:
        if self.retrieval_actor is None:
            return
        name = f"retrieval server at {self.retrieval_url} (Ray actor RetrievalActor)"
        try:
            ray.get(self.retrieval_actor.url.remote(), timeout=self.cfg.cluster.liveness.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise frozen(name, self.cfg.cluster.liveness.timeout_s) from None
        except ray.exceptions.RayActorError as e:
            raise died(name, e) from e

    def release_engine_memory(self) -> None:
        """Colocated engine servers free their GPU memory (weights and KV cache) for training; with
        the lora transport they keep their weights, the base no sync sends again."""
        if self.colocated:
            keep_base = self.cfg.sync_transport() == "lora"
            run_async(self.engine.release_memory([t for t in MEMORY_TAGS if t != "weights"] if keep_base else None))

    def resume_engine_memory(self) -> bool:
        if self.colocated and self.engine.memory_released:
            run_async(self.engine.resume_memory())
            return True
        return False

    def answered(self, actor) -> bool:
        """Whether `actor` answered `lost_parts`' question (all do before it is asked). One that
        did not (its node cut off, or busy) is stopped without being asked to close: a close
        would wait out its deadline."""
        silent = [name for name, a in self.silent if a is actor]
        if silent:
            log.warning("%s did not answer after the failure: stopped without closing it", silent[0])
        return not silent

    def shutdown(self) -> None:
        if self.transport is not None:
            try:
                self.transport.close()
            except Exception as e:  # an engine already gone has nothing left to leave
                log.debug("weight transport close: %s", e)
            self.transport = None
        if self.engine is not None and (self.engine_actor is None or self.answered(self.engine_actor)):
            run_async(self.engine.close())
        if self.reward_pool is not None and self.answered(self.reward_actor):
            self.reward_pool.close()
        if self.fleet is not None:
            from megarl.rollout.sglang_launch import stop_fleet

            stop_fleet(self.fleet, unreachable=[a for _, a in self.silent])
        for actor in (*self.worker_actors, self.engine_actor, self.reward_actor, self.retrieval_actor,
                      *self.sandbox_actors, *self.tool_actors.values()):
            if actor is not None:
                ray.kill(actor)
        self.worker_actors, self.engine_actor, self.reward_actor, self.retrieval_actor = [], None, None, None
        self.sandbox_actors, self.tool_actors = [], {}
        self.engine = self.reward_pool = self.fleet = None
        if self.pg is not None:
            within(PG_REMOVE_S, "removing the run's placement group", remove_placement_group, self.pg)
            self.pg = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


PG_REMOVE_S = 5.0  # Ray frees a job's placement groups when its driver exits: this is only for an early reuse


def placement_bundles(cfg: RunConfig) -> tuple[list[dict], list[list[int]]]:
    """(placement-group bundles, bundle indices of each engine). Bundles: one per train rank,
    the engines' own (the embedded engine actor; fleet servers unless colocated, one per GPU
    of each engine, or on the CPU one per node it spans), and a last one for the retrieval
    server, reward actor and router."""
    world, gpus = cfg.train_world_size(), cfg.cluster.gpus_per_node > 0
    device = {"CPU": 1} | ({"GPU": 1} if gpus else {})
    engines, tp = cfg.num_rollout_engines(), cfg.rollout.tensor_parallel_size
    if cfg.rollout.engine == "local":
        engine_bundles = [[world]]
    elif gpus and cfg.rollout.mode == "colocated":  # on the train ranks' GPUs
        engine_bundles = [[e * tp + j for j in range(tp)] for e in range(engines)]
    else:
        per_engine = tp if gpus else engine_nodes(cfg)
        engine_bundles = [[world + e * per_engine + j for j in range(per_engine)] for e in range(engines)]
    own = sum(1 for b in engine_bundles for i in b if i >= world)
    return [device] * (world + own) + [{"CPU": 1}], engine_bundles
