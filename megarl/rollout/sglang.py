"""The SGLang rollout fleet: engine servers launched by Ray actors, sglang-router in front.

Each engine is one server process (`python -m sglang.launch_server`, or megarl's embedded
engine behind the same API with `rollout.sglang.server=embedded`) started by a
`ServerActor` on the GPUs of its placement-group bundles; the router, when on, is one
more server process. `SGLangFleet` is the `RolloutEngine` the trainer and the agent loop
use: requests carry token ids through the router (cache-aware routing) or, without it, go
to the engine with the fewest in flight; control calls (pause, flush, weight updates,
memory) go to every engine. A request that fails on a dead or erroring engine triggers one
health pass (`/health_generate` with a timeout): dead engines are restarted on the same
address and the request is re-sent. Start-up waits for the health check with a timeout and
fails with the tail of the server's log.

Main entry points: `SGLangFleet`, `ServerProcess` (`ServerActor` in Ray), `server_command`,
`router_command`.
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
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import httpx

from megarl.config import RunConfig, SGLangConfig
from megarl.errors import ComponentDied
from megarl.rollout import sglang_api
from megarl.rollout.engine import GenerationOutput, SamplingParams, WeightBucket
from megarl.rollout.http import HTTPEngine, ServerError

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(cfg: RunConfig, colocated: bool) -> list[str]:
    """The argv of one engine server, without --host / --port (its actor adds them)."""
    r, s = cfg.rollout, cfg.rollout.sglang
    if s.server == "embedded":
        argv = [sys.executable, "-m", "megarl.rollout.serve", "--model-path", cfg.model.path, "--dtype",
                cfg.model.dtype, "--max-running-requests", str(min(r.max_concurrency, 256)),
                "--random-seed", str(cfg.trainer.seed)]
    else:
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model.path,
                "--tp-size", str(r.tensor_parallel_size), "--dtype", cfg.model.dtype,
                "--mem-fraction-static", str(r.gpu_memory_utilization), "--random-seed", str(cfg.trainer.seed),
                "--max-running-requests", str(r.max_concurrency), "--log-level", "warning"]
        if cfg.model.tokenizer_path:
            argv += ["--tokenizer-path", cfg.model.tokenizer_path]
        if cfg.model.trust_remote_code:
            argv.append("--trust-remote-code")
        if colocated:  # weights and KV cache can be released while the trainer runs
            argv.append("--enable-memory-saver")
    return argv + list(s.extra_args)


def router_command(settings: SGLangConfig, worker_urls: Sequence[str], metrics_port: int) -> list[str]:
    """The argv of sglang-router in front of `worker_urls`, without --host / --port."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
            "--policy", settings.router_policy, "--request-timeout-secs", str(int(settings.request_timeout_s)),
            "--worker-startup-timeout-secs", str(int(settings.startup_timeout_s)),
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
    ready once `health_route` answers 200. Restarts keep the address, so the router's worker
    list stays valid. Stopped through its own process group only (nothing is killed by name).
    host None = this node's address (multi-node runs).
    In Ray it runs as `ServerActor` on the node (and GPUs) of its bundle."""

    def __init__(self, argv: Sequence[str], name: str, *, host: str | None = "127.0.0.1", port: int = 0,
                 log_dir: str | None = None, env: dict[str, str] | None = None, health_route: str = "/health"):
        self.argv, self.name, self.health_route = list(argv), name, health_route
        self.host = host or _node_address()
        self.port = port or free_port(self.host)
        self.url = f"http://{self.host}:{self.port}"
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="megarl-servers-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self.env = dict(env or {})
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout_s: float = 900.0) -> str:
        """Launch and wait until healthy; the URL, or RuntimeError with the tail of the log."""
        if self.alive():
            return self.url
        self.starts += 1
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== megarl: start {self.starts} of {self.name}: {' '.join(self.argv)}\n".encode())
            out.flush()
            self.process = subprocess.Popen([*self.argv, "--host", self.host, "--port", str(self.port)],
                                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=_die_with_parent,
                                            env=server_env(os.environ, self.env))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"{self.name} exited with status {code} while starting; the end of "
                                   f"{self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.health_route, timeout=5.0).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer {self.health_route} within {timeout_s:.0f} s "
                           f"(rollout.sglang.startup_timeout_s); the end of {self.log_path}:\n{self.log_tail()}")

    def restart(self, timeout_s: float = 900.0) -> str:
        self.stop()
        return self.start(timeout_s)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

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


class _ServerHandle:
    """The fleet's view of one engine: its HTTP client and the actor that can restart it
    (a megarl.weights.transport.EngineServer)."""

    def __init__(self, name: str, actor, url: str, tp: int, settings: SGLangConfig, node: str = "",
                 gpus: Sequence[str] = ()):
        self.name, self.actor, self.url, self.tp, self.node, self.gpus = name, actor, url, tp, node, tuple(gpus)
        self.client = HTTPEngine(url, timeout_s=settings.request_timeout_s)
        self.in_flight = 0
        self.restarts = 0

    async def call(self, method: str, *args):
        import ray

        try:
            return await getattr(self.actor, method).remote(*args)
        except ray.exceptions.RayActorError as e:
            raise ComponentDied(f"rollout engine {self.name} (Ray actor ServerActor) died: {e}") from e


class SGLangFleet:
    """A `RolloutEngine` over engine servers (see the module docstring), and the
    `EngineServers` the weight transports feed (megarl.weights.transport).

    `engines`: (name, ServerActor handle, url, tp[, node address[, GPU ids]]) per engine, already
    started; `router`: the router's ServerActor and URL, or None. `weight_dir`: storage every
    engine can read, for `update_weights` from this process and for reloading a restarted
    engine.
    """

    def __init__(self, engines: Sequence[tuple], settings: SGLangConfig, *,
                 router: tuple[object, str] | None = None, weight_dir: str | None = None):
        if not engines:
            raise ValueError("an engine fleet needs at least one engine")
        self.settings = settings
        self.servers = [_ServerHandle(*engine[:4], settings, *engine[4:]) for engine in engines]
        self.router_actor, self.router_url = router if router is not None else (None, None)
        self.front = HTTPEngine(self.router_url, timeout_s=settings.request_timeout_s) if router else None
        self.weight_dir = weight_dir
        self.last_weights: tuple[str, int] | None = None  # (directory, version) a restarted engine reloads
        self.failed_requests = 0  # requests re-sent after an engine failure (a metric)
        self.router_restarts = 0
        self.memory_released = False  # release_memory ran; the next weight update takes the memory back
        self._epoch = 0  # health passes so far; a request that failed before the latest one just retries
        self._locks: dict[int, asyncio.Lock] = {}

    # -- generation ---------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        last_error = None
        for attempt in range(self.settings.max_request_retries + 1):
            epoch = self._epoch
            server = None if self.front else min(self.servers, key=lambda s: s.in_flight)
            target = self.front or server.client
            if server is not None:
                server.in_flight += 1
            try:
                return await target.generate(prompt_ids, params)
            except (httpx.TransportError, ServerError) as e:
                if isinstance(e, ServerError) and e.status < 500:
                    raise  # a bad request is not the engine's fault: re-sending cannot help
                last_error = e
                self.failed_requests += 1
                log.warning("generate failed on %s (attempt %d): %s", target.base_url, attempt + 1, e)
                await self._recover(epoch)
            finally:
                if server is not None:
                    server.in_flight -= 1
        raise ComponentDied(f"a generate request failed {self.settings.max_request_retries + 1} times "
                            f"(rollout.sglang.max_request_retries); last error: {last_error}")

    async def _recover(self, failed_in_epoch: int) -> None:
        """One health pass over the engines (restarting the dead), unless one already ran
        since the failed request was sent."""
        loop = id(asyncio.get_running_loop())  # each rollout batch runs in its own event loop
        self._locks = {loop: self._locks.get(loop) or asyncio.Lock()}
        async with self._locks[loop]:
            if self._epoch != failed_in_epoch:
                return
            await asyncio.gather(*[self._check(s) for s in self.servers])
            if self.router_actor is not None:
                await self._check_router()
            self._epoch += 1

    async def _check_router(self) -> None:
        """Restart the router if its process is gone (same address: the URL stays valid)."""
        import ray

        try:
            if await self.router_actor.alive.remote():
                return
            log.warning("sglang-router at %s is gone: restarting it", self.router_url)
            await self.router_actor.restart.remote(self.settings.startup_timeout_s)
        except ray.exceptions.RayError as e:
            raise ComponentDied(f"sglang-router at {self.router_url} could not be restarted: {e}") from e
        self.router_restarts += 1

    async def _check(self, server: _ServerHandle) -> None:
        if await server.call("alive") and await server.client.health(self.settings.health_timeout_s):
            return
        if server.restarts >= self.settings.max_restarts:
            tail = await server.call("log_tail")
            raise ComponentDied(f"rollout engine {server.name} at {server.url} failed again after "
                                f"{server.restarts} restarts (rollout.sglang.max_restarts); its log ends:\n{tail}")
        server.restarts += 1
        log.warning("rollout engine %s at %s is not healthy: restart %d", server.name, server.url, server.restarts)
        try:
            await server.call("restart", self.settings.startup_timeout_s)
        except ComponentDied:
            raise
        except Exception as e:  # the actor's RuntimeError carries the log tail
            raise ComponentDied(f"rollout engine {server.name} could not be restarted: {e}") from e
        if self.last_weights is not None:  # back to the trainer's newest weights
            await server.client.load_from_disk(*self.last_weights)

    async def health(self) -> bool:
        return all(await asyncio.gather(*[s.client.health(self.settings.health_timeout_s) for s in self.servers]))

    # -- control, on every engine -------------------------------------------------------------
    async def _each(self, method: str, *args) -> list:
        return await asyncio.gather(*[getattr(s.client, method)(*args) for s in self.servers])

    async def check_engines(self) -> None:
        """A health pass now, restarting dead engines: the router re-sends the requests of a
        dead engine to the others by itself, so the fleet may not see the failure. Run before
        every weight sync (so a restarted engine gets the new weights too), while the engines
        still hold their memory (a health check generates a token)."""
        await self._recover(self._epoch)

    async def pause(self) -> None:
        await self._each("pause")

    async def resume(self) -> None:
        await self._each("resume")

    async def flush_cache(self) -> None:
        await self._each("flush_cache")

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the engines' GPU memory for a trainer on the same GPUs: a health pass first
        (it generates a token, which needs the KV cache), then each kind of sglang_api.MEMORY_TAGS,
        named explicitly so that exactly those are resumed."""
        await self.check_engines()
        await self._each("release_memory", list(tags or sglang_api.MEMORY_TAGS))
        self.memory_released = True

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self._each("resume_memory", list(tags or sglang_api.MEMORY_TAGS))

    async def begin_weight_update(self) -> None:
        """The weights' memory back if released (else a health pass, so that a restarted
        engine gets the new weights too), then pause."""
        if self.memory_released:
            await self.resume_memory(["weights"])
        else:
            await self.check_engines()
        await self.pause()

    async def end_weight_update(self) -> None:
        """Flush the stale prefix cache, the KV cache back if released, then continue."""
        await self.flush_cache()
        if self.memory_released:
            await self.resume_memory([t for t in sglang_api.MEMORY_TAGS if t != "weights"])
            self.memory_released = False
        await self.resume()

    # -- weights -----------------------------------------------------------------------------
    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Buckets from this process: written once as safetensors into `weight_dir`, then
        loaded by every engine (the disk transport)."""
        from megarl.weights.disk import write_buckets

        directory = Path(tempfile.mkdtemp(dir=self.weight_dir, prefix=f"v{version:06d}-"))
        write_buckets(buckets, directory, "bucket")
        await self.load_from_disk(str(directory), version)

    async def load_from_disk(self, directory: str, version: int) -> None:
        """Every engine loads the safetensors files of `directory`; the directory is kept as
        the weights a restarted engine reloads (and the one kept before it is removed)."""
        await self._each("load_from_disk", directory, version)
        previous, self.last_weights = self.last_weights, (directory, version)
        if previous is not None and previous[0] != directory:
            import shutil

            shutil.rmtree(previous[0], ignore_errors=True)

    @property
    def engine_restarts(self) -> int:
        return sum(s.restarts for s in self.servers)

    async def post(self, server: _ServerHandle, route: str, body: dict, timeout_s: float | None = None) -> dict:
        """POST a control body to one engine (megarl.weights.transport.EngineServers)."""
        return await server.client.post(route, body, timeout_s=timeout_s)

    async def post_each(self, route: str, body: dict, timeout_s: float | None = None) -> list[dict]:
        return await asyncio.gather(*[self.post(s, route, body, timeout_s) for s in self.servers])

    async def weight_checksums(self) -> dict[str, str]:
        """Engine 0's checksums, after checking that every engine holds the same weights."""
        sums = await self._each("weight_checksums")
        for s, other in zip(self.servers[1:], sums[1:]):
            if other != sums[0]:
                differ = sorted(n for n in set(other) | set(sums[0]) if other.get(n) != sums[0].get(n))
                raise RuntimeError(f"rollout engine {s.name} holds other weights than {self.servers[0].name}: "
                                   f"{len(differ)} tensors differ, e.g. {differ[:5]}")
        return sums[0]

    @property
    def engine_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def metrics(self) -> dict[str, float]:
        return {"rollout/engine_restarts": float(sum(s.restarts for s in self.servers)),
                "rollout/router_restarts": float(self.router_restarts),
                "rollout/resent_requests": float(self.failed_requests)}

    async def close(self) -> None:
        for client in [s.client for s in self.servers] + ([self.front] if self.front else []):
            await client.close()


def _bundle_device():
    """(node address, GPU ids) of the placement-group bundle this task runs in."""
    import ray

    return ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]


def launch_fleet(cfg: RunConfig, placement_group, engine_bundles: list[list[int]], router_bundle: int,
                 log_dir: str, weight_dir: str) -> SGLangFleet:
    """Start one server per engine on its bundles (all of one node; the server sees exactly
    their GPUs), then the router, and return the fleet. `engine_bundles[e]` lists the
    bundle indices whose GPUs engine e uses (shared with train ranks when colocated)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def place(i):
        return PlacementGroupSchedulingStrategy(placement_group=placement_group, placement_group_bundle_index=i)

    s, gpus = cfg.rollout.sglang, cfg.cluster.gpus_per_node > 0
    colocated = gpus and cfg.rollout.mode == "colocated"
    host = s.host or ("127.0.0.1" if cfg.cluster.nnodes == 1 else None)
    probe = ray.remote(_bundle_device)
    devices = {i: ray.get(probe.options(num_cpus=0, num_gpus=0.01 if gpus else 0, scheduling_strategy=place(i)).remote())
               for bundles in engine_bundles for i in bundles}
    server_actor = ray.remote(ServerProcess)
    argv = server_command(cfg, colocated)
    actors, nodes = [], []
    for e, bundles in enumerate(engine_bundles):
        where = {devices[i][0] for i in bundles}
        if len(where) > 1:
            raise RuntimeError(f"rollout engine {e}'s {len(bundles)} GPUs landed on several nodes {sorted(where)}; "
                               "an engine's TP ranks must share a node (rollout.tensor_parallel_size)")
        engine_gpus = [g for i in bundles for g in devices[i][1]]  # TP rank i runs on the i-th
        env = {"CUDA_VISIBLE_DEVICES": ",".join(engine_gpus)} if gpus else {}
        actors.append(server_actor.options(num_cpus=0, num_gpus=(0.2 if colocated else 1) if gpus else 0,
                                           scheduling_strategy=place(bundles[0])).remote(
            argv, f"engine{e}", host=host, log_dir=log_dir, env=env))
        nodes.append((where.pop(), engine_gpus))
    urls = _start_all(actors, [f"rollout engine {e}" for e in range(len(actors))], s.startup_timeout_s)
    router = None
    if s.router:
        actor = server_actor.options(num_cpus=0, scheduling_strategy=place(router_bundle)).remote(
            router_command(s, urls, free_port()), "router", host=host, log_dir=log_dir)
        router = (actor, _start_all([actor], ["sglang-router"], s.startup_timeout_s)[0])
    fleet = SGLangFleet([(f"engine{e}", a, u, cfg.rollout.tensor_parallel_size, node, engine_gpus)
                         for e, (a, u, (node, engine_gpus)) in enumerate(zip(actors, urls, nodes))], s, router=router,
                        weight_dir=weight_dir)
    log.info("rollout fleet: %d %s engines (TP %d) at %s%s", len(urls), s.server, cfg.rollout.tensor_parallel_size,
             urls, f", router at {router[1]}" if router else "")
    return fleet


def _start_all(actors: list, names: list[str], timeout_s: float) -> list[str]:
    import ray

    refs = [a.start.remote(timeout_s) for a in actors]
    urls = []
    for name, ref in zip(names, refs):
        try:
            urls.append(ray.get(ref))
        except ray.exceptions.RayError as e:
            raise ComponentDied(f"{name} failed to start: {e}") from None
    return urls


def stop_fleet(fleet: SGLangFleet) -> None:
    """Stop the router and every server (each through its own process group), then the actors."""
    import ray

    actors = ([fleet.router_actor] if fleet.router_actor is not None else []) + [s.actor for s in fleet.servers]
    try:
        ray.get([a.stop.remote() for a in actors], timeout=60)
    except (ray.exceptions.RayError, TimeoutError) as e:  # an actor already gone took its server with it
        log.debug("fleet stop: %s", e)
    for actor in actors:
        ray.kill(actor)
