"""The SGLang rollout fleet: engine servers behind sglang-router, as one `RolloutEngine`.

The servers and the router are processes started by megarl.rollout.sglang_launch. `SGLangFleet`
is the `RolloutEngine` the trainer and the agent loop use: requests carry token ids through the
router (cache-aware routing) or, without it, go to the engine with the fewest in flight;
control calls (pause, flush, weight updates, memory) go to every engine. A request that fails
on a dead or erroring engine, or makes no progress on one that fails its health check, triggers
one health pass (`/health_generate` with a timeout): dead engines are restarted on the same
address and the request is re-sent. Main entry point: `SGLangFleet`.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import threading
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from pathlib import Path

import httpx

from megarl.config import SGLangConfig
from megarl.config_cluster import LivenessConfig
from megarl.errors import ComponentDied
from megarl.http_transport import ROUTER_KEEPALIVE_S
from megarl.rollout import sglang_api
from megarl.rollout.engine import GenerationOutput, SamplingParams, WeightBucket
from megarl.rollout.engine_unit import EngineUnit
from megarl.rollout.http import HTTPEngine, ServerError
from megarl.weights.adapters import adapter_name
from megarl.weights.probe import WrongWeights

log = logging.getLogger(__name__)

ROUTER_WAIT_S = 1.0  # between tries while sglang-router answers that it has no engine to send to


class EngineStalled(RuntimeError):
    """A generate request outlived the progress deadline on an engine that fails its health check."""


class _ServerHandle:
    """The fleet's view of one engine: its HTTP client (node rank 0's API) and the server
    processes that can restart it (an EngineUnit, or the one ServerActor of an engine on one
    node); a megarl.weights.transport.EngineServer. `node`, `gpus`: node rank 0's address and
    the GPU of each TP rank on its node, in TP order; `rank_nodes`: the node of each TP rank
    (all `node` by default)."""

    def __init__(self, name: str, actor, url: str, tp: int, settings: SGLangConfig, node: str = "",
                 gpus: Sequence[str] = (), rank_nodes: Sequence[str] | None = None, *, api_key: str | None = None):
        self.name, self.url, self.tp, self.node, self.gpus = name, url, tp, node, tuple(gpus)
        self.rank_nodes = tuple(rank_nodes) if rank_nodes is not None else (node,) * len(self.gpus)
        self.unit = actor if isinstance(actor, EngineUnit) else EngineUnit([actor])
        self.client = HTTPEngine(url, timeout_s=settings.request_timeout_s, api_key=api_key)
        self.in_flight = 0
        self.restarts = 0
        self.released: set[str] = set()  # its memory tags released and not resumed (none after a restart)

    async def call(self, method: str, *args, timeout_s: float = 60.0):
        """`method` of the engine's EngineUnit (over its ServerActors), within `timeout_s`."""
        import ray

        try:
            return await asyncio.wait_for(getattr(self.unit, method)(*args), timeout_s)
        except ray.exceptions.RayActorError as e:
            raise ComponentDied(f"rollout engine {self.name} (Ray actor ServerActor) died: {e}") from e
        except asyncio.TimeoutError:
            raise ComponentDied(f"rollout engine {self.name}'s Ray actor (ServerActor) did not answer {method} within "
                                f"{timeout_s:.0f} s") from None


class SGLangFleet:
    """A `RolloutEngine` over engine servers (see the module docstring), and the
    `EngineServers` the weight transports feed (megarl.weights.transport).

    `engines`: (name, EngineUnit or ServerActor handle, url, tp[, node address[, GPU ids[, node of
    each TP rank]]]) per engine, already started; `router`: the router's ServerActor and URL, or
    None. `weight_dir`: storage every engine can read, for `update_weights` from this process and for reloading a restarted
    engine. `api_key`: the key the servers and the router were started with; every request
    of the fleet, and of the transports' senders, carries it.
    """

    def __init__(self, engines: Sequence[tuple], settings: SGLangConfig, *,
                 router: tuple[object, str] | None = None, weight_dir: str | None = None,
                 liveness: LivenessConfig | None = None, api_key: str | None = None):
        if not engines:
            raise ValueError("an engine fleet needs at least one engine")
        self.settings = settings
        self.liveness = liveness or LivenessConfig()
        self.api_key = api_key
        self.servers = [_ServerHandle(*engine[:4], settings, *engine[4:], api_key=api_key) for engine in engines]
        self.router_actor, self.router_url = router if router is not None else (None, None)
        # the router keeps idle connections open: thousands of them are reused, not reopened
        self.front = HTTPEngine(self.router_url, timeout_s=settings.request_timeout_s, api_key=api_key,
                                keepalive_s=ROUTER_KEEPALIVE_S) if router else None
        self.weight_dir = weight_dir
        self.last_weights: tuple[str, int] | None = None  # (directory, version) a restarted engine reloads
        self.serves_adapters = False  # last_weights is a LoRA adapter (the lora transport), not whole weights
        self.failed_requests = 0  # requests re-sent after an engine failure (a metric)
        self.router_restarts = 0
        self.memory_released = False  # an engine has memory released: resume_memory gives it back
        self.synced = False  # a weight sync has begun: the checkpoint's weights are no longer the trainer's
        self.probe = None  # the run's WeightProbe (megarl.weights.probe): a restarted engine is probed after its reload
        # engines restarted after a sync's load with nothing kept to reload: the runtime syncs them again
        self.need_weights: set[str] = set()
        self._after_load = False  # inside end_weight_update: the sync's weights are in
        self.syncing = False  # between begin_ and end_weight_update: the engines are paused on purpose
        self.around_restart = nullcontext  # the runtime's: what the GPU must be rid of while an engine starts
        self._epoch = 0  # health passes so far; a request that failed before the latest one just retries
        self._locks: dict[int, asyncio.Lock] = {}
        # cleared by abort_requests until the sync ends; a threading.Event: the trainer's thread
        # aborts while the rollouts' event loop, in another thread, generates
        self._open = threading.Event()
        self._open.set()

    # -- generation ---------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        held_until = asyncio.get_running_loop().time() + self.settings.request_timeout_s
        while not self._open.is_set():  # held here from abort_requests until the sync is over
            if asyncio.get_running_loop().time() > held_until:
                raise ComponentDied(f"a generate request was held {self.settings.request_timeout_s:.0f} s "
                                    "(rollout.sglang.request_timeout_s) after abort_requests, and no weight sync "
                                    "ended in that time")
            await asyncio.sleep(0.01)
        last_error, attempt, refused_since = None, 0, None
        while attempt <= self.settings.max_request_retries:
            epoch = self._epoch
            server = None if self.front else min(self.servers, key=lambda s: s.in_flight)
            target = self.front or server.client
            if server is not None:
                server.in_flight += 1
            try:
                return await self._progressing(target.generate(prompt_ids, params), [server] if server else self.servers)
            except (httpx.TransportError, ServerError, EngineStalled) as e:
                if isinstance(e, ServerError) and e.status < 500:
                    raise  # a bad request is not the engine's fault: re-sending cannot help
                last_error, refused = e, _router_has_no_worker(e)
                if not (refused and refused_since is not None):  # a refusal is logged once, not each second
                    self.failed_requests += 1
                    log.warning("generate failed on %s (attempt %d): %s", target.base_url, attempt + 1, e)
                await self._recover(epoch, router_lost=self.front is not None and _connection_lost(e))
                if refused:
                    # the health pass found the engines alive (or restarted them): the router has
                    # yet to take them back. The attempt is not spent; the wait is bounded
                    now = asyncio.get_running_loop().time()
                    refused_since = now if refused_since is None else refused_since
                    if now - refused_since < self.settings.startup_timeout_s:
                        await asyncio.sleep(ROUTER_WAIT_S)
                        continue
                attempt += 1
            finally:
                if server is not None:
                    server.in_flight -= 1
        raise ComponentDied(f"a generate request failed {self.settings.max_request_retries + 1} times "
                            f"(rollout.sglang.max_request_retries); last error: {last_error}")

    async def _progressing(self, call, suspects: Sequence[_ServerHandle]):
        """`call`'s result. Each time it has run cluster.liveness.progress_timeout_s, the engines
        it may be on get a health check (SGLang's passes while it still produces tokens): one
        that fails makes the call fail (EngineStalled), so it is recovered and re-sent. None while
        a weight sync holds the engines paused: a sync finds a dead engine by itself."""
        task = asyncio.ensure_future(call)
        try:
            while not (await asyncio.wait({task}, timeout=self.liveness.progress_timeout_s))[0]:
                if self.syncing:  # paused by the sync: SGLang parks a health check then and fails it after 20 s
                    continue
                healthy = await asyncio.gather(*[s.client.health(self.settings.health_timeout_s) for s in suspects])
                stalled = [s.name for s, ok in zip(suspects, healthy) if not ok]
                if stalled:
                    raise EngineStalled(f"rollout engines {stalled} produced nothing for "
                                        f"{self.liveness.progress_timeout_s:.0f} s and failed a health check")
            return task.result()
        finally:
            task.cancel()

    async def _recover(self, failed_in_epoch: int, before_sync: bool = False, router_lost: bool = False) -> None:
        """One health pass over the engines (restarting the dead), unless one already ran
        since the failed request was sent. `before_sync`: a weight sync follows before the
        engines generate again (it brings a restarted engine the trainer's weights)."""
        loop = id(asyncio.get_running_loop())  # each rollout batch runs in its own event loop
        self._locks = {loop: self._locks.get(loop) or asyncio.Lock()}
        async with self._locks[loop]:
            if self._epoch != failed_in_epoch:
                return
            await asyncio.gather(*[self._check(s, before_sync) for s in self.servers])
            if self.router_actor is not None:
                await self._check_router(router_lost)
            self._epoch += 1

    async def _check_router(self, lost: bool = False) -> None:
        """Restart the router if its process is gone (same address: the URL stays valid). `lost`:
        the router's connection broke, so its process may be going but not yet reaped: it is
        given 10 s to be seen gone before it counts as alive."""
        import ray

        try:
            if lost:
                gone = await asyncio.wait_for(self.router_actor.gone_within.remote(10.0), 70)
            else:
                gone = not await asyncio.wait_for(self.router_actor.alive.remote(), 60)
            if not gone:
                return
            log.warning("sglang-router at %s is gone: restarting it", self.router_url)
            await asyncio.wait_for(self.router_actor.restart.remote(self.settings.startup_timeout_s),
                                   self.settings.startup_timeout_s + 60)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
            raise ComponentDied(f"sglang-router at {self.router_url} could not be restarted: {e}") from e
        self.router_restarts += 1

    async def _check(self, server: _ServerHandle, before_sync: bool = False) -> None:
        if await server.call("alive") and await server.client.health(self.settings.health_timeout_s):
            return
        await self._restart(server, before_sync)

    async def _restart(self, server: _ServerHandle, before_sync: bool) -> None:
        """Restart `server` on its address and give it the trainer's newest weights (see _check)."""
        if server.restarts >= self.settings.max_restarts:
            tail = await server.call("log_tail")
            raise ComponentDied(f"rollout engine {server.name} at {server.url} failed again after "
                                f"{server.restarts} restarts (rollout.sglang.max_restarts); its log ends:\n{tail}")
        server.restarts += 1
        server.released = set()  # a fresh engine holds all its memory
        log.warning("rollout engine %s at %s is not healthy: restart %d", server.name, server.url, server.restarts)
        try:
            with self.around_restart():
                await server.call("restart", self.settings.startup_timeout_s,
                                  timeout_s=self.settings.startup_timeout_s + 60)
        except ComponentDied:
            raise
        except Exception as e:  # the actor's RuntimeError carries the log tail
            raise ComponentDied(f"rollout engine {server.name} could not be restarted: {e}") from e
        server.client.adapter = None  # a fresh engine holds no adapter
        if self.last_weights is not None:  # back to the trainer's newest weights
            await self._reload(server)
            await self._probe_reloaded(server)
        elif self.synced and not before_sync and self._after_load:
            # restarted at the end of a sync: the runtime gives it the sync's weights again (Runtime.sync_weights)
            log.warning("rollout engine %s was restarted after the sync's load; the trainer's weights are sent again",
                        server.name)
            self.need_weights.add(server.name)
        elif self.synced and not before_sync:
            # it serves the checkpoint it started from, and its samples would enter the step as
            # the trainer's: the process-group and IPC transports keep no copy it could reload
            raise ComponentDied(f"rollout engine {server.name} at {server.url} was restarted mid-rollout and holds "
                                "the checkpoint's weights, not the trainer's; this weight transport keeps no copy to "
                                "reload. Resume the run from its last checkpoint (trainer.resume=auto), or use "
                                "sync.transport=disk, whose newest weights a restarted engine reloads")

    async def _probe_reloaded(self, server: _ServerHandle) -> None:
        """The weights probe on an engine restarted and given the kept weights (when the probe's
        trainer log-probs are for them): one more load on a mismatch, then WrongWeights."""
        probe = self.probe
        if probe is None or probe.expected is None or probe.version != self.last_weights[1]:
            return  # the probe after the next sync checks it
        name = f"rollout engine {server.name} at {server.url}"
        for attempt in range(2):
            (answer,) = (await server.client.probe_log_probs(probe.sequences)).values()
            mismatch = probe.compare(name, answer)
            if mismatch.mean_abs <= probe.tolerance:
                return
            if not attempt:
                log.warning("sync.probe: after its restart and reload, %s; loading its weights again",
                            mismatch.describe(probe.tolerance))
                await self._reload(server)
        raise WrongWeights(f"{name} serves other weights than the trainer's (version {probe.version}) after its "
                           f"restart and reload, and again after a second load: {mismatch.describe(probe.tolerance)}")

    async def health(self) -> bool:
        return all(await asyncio.gather(*[s.client.health(self.settings.health_timeout_s) for s in self.servers]))

    # -- control, on every engine -------------------------------------------------------------
    # control calls through which a weight sync has brought the engines the new weights (or
    # keeps them in `last_weights`): an engine restarted before or during them gets the weights
    # from the sync itself; after them it needs a copy to reload (resume_memory says which it is)
    _UP_TO_THE_LOAD = frozenset({"pause", "open_update_session", "load_from_disk", "load_adapter", "release_memory"})

    async def _each(self, method: str, *args, before_load: bool | None = None, args_of=None) -> list:
        """`method` of every engine's client. An engine whose process died is restarted (with the
        newest weights where they are kept) and gets the call once more, but for a resume of
        memory: a fresh engine holds all of it, and SGLang fails a resume of a tag it never released
        (its scheduler's offload_tags.remove raises). `before_load`: whether the sync's load is
        still to come (default: by the method). `args_of`: each engine's arguments instead of
        `args`, from its handle; None leaves that engine out."""
        async def one(server: _ServerHandle, args: tuple):
            try:
                return await getattr(server.client, method)(*args)
            except (RuntimeError, httpx.TransportError) as e:
                if not _connection_lost(e) or not await server.call("gone_within", 10.0, timeout_s=70.0):
                    raise
                # only this engine: a health check of the others would wait on their pause
                log.warning("rollout engine %s died during %s (%s): restarting it", server.name, method, e)
                await self._restart(server, before_sync=method in self._UP_TO_THE_LOAD if before_load is None
                                    else before_load)
                if method == "resume_memory":
                    return None
                return await getattr(server.client, method)(*args)
        each = [(s, args if args_of is None else args_of(s)) for s in self.servers]
        return await asyncio.gather(*[one(s, a) for s, a in each if a is not None])

    async def check_engines(self) -> None:
        """A health pass now, restarting dead engines: the router re-sends the requests of a
        dead engine to the others by itself, so the fleet may not see the failure. Run before
        every weight sync (so a restarted engine gets the new weights too), while the engines
        still hold their memory (a health check generates a token)."""
        await self._recover(self._epoch, before_sync=True)

    async def abort_requests(self) -> None:
        """Every engine ends its requests with the tokens they have (RolloutEngine.abort_requests);
        the calls through the router are marked as ours too. New requests (the continuations of
        the aborted ones) wait in `generate` until end_weight_update: sent now, they would start
        on the old weights, and SGLang's pause would retract them into the queue."""
        self._open.clear()
        for client in [self.front] * (self.front is not None) + [s.client for s in self.servers]:
            client.mark_preempted()
        async def abort(server: _ServerHandle):
            try:
                await self.post(server, "/abort_request", sglang_api.abort_all_body())
            except RuntimeError as e:  # a dead engine has nothing left to abort
                if not _connection_lost(e):
                    raise
                log.warning("rollout engine %s did not answer the abort: %s", server.name, e)
        await asyncio.gather(*[abort(s) for s in self.servers])

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
        if self.memory_released:
            return  # released already (a health check now would need the KV cache)
        await self.check_engines()
        tags = list(tags or sglang_api.MEMORY_TAGS)
        await self._each("release_memory", tags)
        for server in self.servers:
            server.released |= set(tags)
        self.memory_released = True

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        """Each engine gets back what it released of `tags` (by default all it released), and
        nothing else: SGLang fails a resume of a tag it never released (its scheduler's
        offload_tags.remove raises) and serves requests on whatever is left released. Engines
        serving LoRA adapters keep their weights; one restarted since the release holds all its
        memory. The weights alone come back before a sync's load; anything else after it."""
        wanted = set(tags or sglang_api.MEMORY_TAGS)

        def back(server: _ServerHandle) -> tuple | None:
            named = [t for t in sglang_api.MEMORY_TAGS if t in wanted & server.released]
            return (named,) if named else None

        await self._each("resume_memory", before_load=wanted == {"weights"}, args_of=back)
        for server in self.servers:
            server.released -= wanted
        self.memory_released = any(server.released for server in self.servers)

    async def begin_weight_update(self) -> None:
        """The weights' memory back if released (else a health pass, so that a restarted
        engine gets the new weights too), then pause and open each engine's weight-update
        session (SGLang loads weights from a process group or tensors only inside one)."""
        if self.memory_released:
            await self.resume_memory(["weights"])
        else:
            await self.check_engines()
        self.synced = True
        self.syncing = True
        await self.pause()
        await self._each("open_update_session")

    async def end_weight_update(self) -> None:
        """Close the sessions, flush the stale prefix cache, the KV cache back if released,
        then continue. An engine restarted during the sync has no session to close."""
        self._after_load = True
        try:
            await self._each("close_update_session", True)
            await self.flush_cache()
            if self.memory_released:
                await self.resume_memory()  # the weights came back in begin_weight_update
            await self.resume()
        finally:
            self._after_load = self.syncing = False
            self._open.set()

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
        self._keep(directory, version)

    async def load_adapter(self, directory: str, version: int) -> None:
        """Every engine loads PEFT's adapter directory `directory` and serves every request with
        it from now on, through the router too; kept for restarts as load_from_disk's is."""
        await self._each("load_adapter", directory, version)
        self.serves_adapters = True
        if self.front is not None:
            self.front.adapter = adapter_name(version)
        self._keep(directory, version)

    async def _reload(self, server: _ServerHandle) -> None:
        """A restarted engine gets the kept weights (or adapter) again."""
        load = server.client.load_adapter if self.serves_adapters else server.client.load_from_disk
        await load(*self.last_weights)

    def _keep(self, directory: str, version: int) -> None:
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

    async def probe_log_probs(self, sequences: list[list[int]]) -> dict[str, list[list[float]]]:
        """Each engine's answer to the weights probe, by its name (not through the router: every
        engine is probed). An engine whose process died is restarted and probed once more: it
        answers with the weights it reloaded, or with the checkpoint's, which the probe finds
        wrong and the runtime syncs again (Runtime.check_engine_weights). ComponentDied naming an
        engine that does not answer within cluster.liveness.timeout_s."""
        async def one(server: _ServerHandle) -> list[list[float]]:
            for attempt in range(2):
                try:
                    return list(await asyncio.gather(*[server.client.prompt_log_probs(s, self.liveness.timeout_s)
                                                       for s in sequences]))
                except (httpx.HTTPError, ServerError) as e:
                    if attempt or not _connection_lost(e) or not await server.call("gone_within", 10.0,
                                                                                  timeout_s=70.0):
                        raise self._no_probe_answer(server, e) from e
                    log.warning("rollout engine %s died before the weights probe (%s): restarting it", server.name, e)
                    await self._restart(server, before_sync=True)  # the probe decides whether it needs a sync

        answers = await asyncio.gather(*[one(s) for s in self.servers])
        return {f"rollout engine {s.name} at {s.url}": a for s, a in zip(self.servers, answers)}

    def _no_probe_answer(self, server: _ServerHandle, e: Exception) -> ComponentDied:
        return ComponentDied(f"rollout engine {server.name} at {server.url} did not answer the weights probe "
                             f"(sync.probe) within {self.liveness.timeout_s:.0f} s: {type(e).__name__}: {e}")

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


def _router_has_no_worker(error: BaseException) -> bool:
    """sglang-router's 503 when it holds every engine out (its health checks, or a circuit)."""
    return isinstance(error, ServerError) and error.status == 503 and "no_available_workers" in str(error)


def _connection_lost(error: BaseException) -> bool:
    """The server's connection failed (refused, reset, closed mid-answer): its process is gone,
    or going; not an answer of the server."""
    return isinstance(error, httpx.TransportError) or isinstance(error.__cause__, httpx.TransportError)
