"""The nccl transport: a weight-update process group per pipeline stage between that
stage's source rank (rank 0) and every engine's TP ranks; each flat bucket is broadcast
while the engines are told (`/update_weights_from_distributed`) what to receive.

NCCL between GPUs (disaggregated engines), gloo where CUDA is absent (CPU runs and tests).
The group is set up exactly as SGLang's engine side sets it up, so a trainer rank and an
SGLang server meet in it (`open_update_group`); an engine that restarts has left it, and
the groups are opened again before the next sync. Main entry points: `GroupTransport`,
`GroupSender`, `open_update_group`, `receive_bucket`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import httpx
import torch
from fastapi import Request

from megarl.driver_loop import run_async
from megarl.http_auth import bearer
from megarl.weights.buckets import FlatBucket, TensorEntry, WeightBucket, flatten, split_by_dtype, unpack_bucket
from megarl.weights.routes import json_body, result, session_refusal, version_of
from megarl.weights.transport import EngineServers, TrainRanks, WeightSender, WeightTransport, needs_engine_servers, \
    sources

log = logging.getLogger(__name__)

# SGLang's load_format for one flat buffer per bucket: tensors packed back to back in order,
# no padding (its FlattenedTensorBucket); `flatten(..., packed=True)` packs the same way.
FLATTENED_BUCKET = "flattened_bucket"


def init_group_body(master_address: str, master_port: int, rank_offset: int, world_size: int,
                    group_name: str, backend: str) -> dict:
    """Join a weight-update process group: the trainer is rank 0, the engine's TP ranks are
    rank_offset .. rank_offset + tp - 1."""
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def destroy_group_body(group_name: str) -> dict:
    return {"group_name": group_name}


def distributed_update_body(names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                            version: int) -> dict:
    """Receive one flat bucket broadcast from rank 0 of the group and load it."""
    return {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
            "group_name": group_name, "weight_version": str(version), "load_format": FLATTENED_BUCKET,
            "flush_cache": False}


def open_update_group(backend: str, address: str, port: int, rank: int, world_size: int, group_name: str,
                      timeout_s: float = 600.0):
    """A process group of its own (not the default one, which megatron owns) for weight
    updates. It mirrors SGLang's `init_custom_process_group` key for key (a TCP rendezvous,
    then a store prefixed with the group name), which is what lets a trainer rank and an
    SGLang server meet in it; rank 0 hosts the store."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def close_update_group(group) -> None:
    torch.distributed.destroy_process_group(group)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def broadcast_bucket(group, bucket: FlatBucket) -> None:
    """Rank 0 sends one packed bucket to every rank of the group."""
    torch.distributed.broadcast(bucket.data, src=0, group=group)


def receive_bucket(group, names: list[str], dtypes: list[str], shapes: list[list[int]],
                   device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The receiving side of `broadcast_bucket`: the packed layout rebuilt from the names,
    dtypes and shapes alone (as SGLang's FlattenedTensorBucket does)."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(f"names, dtypes and shapes must be non-empty and equally long "
                         f"({len(names)}, {len(dtypes)}, {len(shapes)})")
    entries, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        torch_dtype = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"{name}: unknown dtype {dtype!r}")
        if any(d < 0 for d in shape):
            raise ValueError(f"{name}: negative dimension in shape {shape}")
        nbytes = torch.Size(shape).numel() * torch_dtype.itemsize
        if offset % torch_dtype.itemsize:
            raise ValueError(f"{name}: byte offset {offset} is not a multiple of {dtype}'s size")
        entries.append(TensorEntry(name, str(torch_dtype).removeprefix("torch."), tuple(shape), offset, nbytes))
        offset += nbytes
    bucket = FlatBucket(torch.empty(offset, dtype=torch.uint8, device=device), entries)
    torch.distributed.broadcast(bucket.data, src=0, group=group)
    return unpack_bucket(bucket)


class DistributedSender:
    """A source rank's end of the nccl transport: it owns the group with the engines and, for
    each bucket, tells every engine what to receive and broadcasts it.

    The HTTP calls block until the engine has received and loaded the bucket, so they run on
    threads while this rank broadcasts; a failed call raises after the broadcast (an engine
    that refused the bucket never joined it, and the broadcast fails with a timeout instead).
    """

    def __init__(self, group, engine_urls: list[str], group_name: str, timeout_s: float = 600.0,
                 api_key: str | None = None):
        self.group, self.engine_urls, self.group_name = group, list(engine_urls), group_name
        self.client = httpx.Client(timeout=timeout_s, headers=bearer(api_key))
        self.pool = ThreadPoolExecutor(max_workers=max(len(self.engine_urls), 1), thread_name_prefix="megarl-sync")

    def send(self, buckets: Iterable[WeightBucket], version: int) -> int:
        count = 0
        for group in (one_dtype for bucket in buckets for one_dtype in split_by_dtype(bucket)):
            flat = flatten(group, packed=True)
            body = distributed_update_body(flat.names, [e.dtype for e in flat.entries],
                                                      [list(e.shape) for e in flat.entries], self.group_name, version)
            calls = [self.pool.submit(self.client.post, url + "/update_weights_from_distributed", json=body)
                     for url in self.engine_urls]
            try:
                broadcast_bucket(self.group, flat)
            except RuntimeError as e:  # an engine that refused the bucket never joined: say which and why
                refusals = self._refusals(calls, wait_s=0.0)
                raise RuntimeError(f"broadcast of a weight bucket over {self.group_name} failed ({e}); "
                                   + ("; ".join(refusals) or "no engine refused it")) from e
            refusals = self._refusals(calls)
            if refusals:
                raise RuntimeError("; ".join(refusals))
            count += 1
        return count

    def _refusals(self, calls, wait_s: float | None = None) -> list[str]:
        """What each engine that failed the bucket answered (those still busy after `wait_s`
        seconds are left out; None waits for every answer)."""
        refusals = []
        for url, call in zip(self.engine_urls, calls):
            try:
                response = call.result(timeout=wait_s)
            except TimeoutError:
                continue
            except httpx.HTTPError as e:
                refusals.append(f"{url} did not answer the weight bucket: {e}")
                continue
            if response.status_code != 200 or not response.json().get("success"):
                refusals.append(f"{url} failed to load a weight bucket over the update group {self.group_name}: "
                                f"{response.status_code} {response.text[:500]}")
        return refusals

    def close(self) -> None:
        self.client.close()
        self.pool.shutdown(wait=False)
        close_update_group(self.group)


class GroupSender(WeightSender):
    """A source rank's end: hosts the group `group_name` as its rank 0 (`open` returns once
    every engine rank has joined), then broadcasts each bucket (`DistributedSender`); its
    requests carry the engines' `api_key`."""

    def __init__(self, backend: str, address: str, port: int, world_size: int, group_name: str,
                 engine_urls: list[str], api_key: str | None = None, timeout_s: float = 600.0):
        self.backend, self.address, self.port = backend, address, port
        self.world_size, self.group_name, self.engine_urls = world_size, group_name, list(engine_urls)
        self.api_key, self.timeout_s = api_key, timeout_s
        self.sender: DistributedSender | None = None

    def open(self) -> None:
        """Host the group (each of its collectives may take `timeout_s`) once every engine joined."""
        group = open_update_group(self.backend, self.address, self.port, 0, self.world_size, self.group_name,
                                  self.timeout_s)
        self.sender = DistributedSender(group, self.engine_urls, self.group_name, api_key=self.api_key)

    def send(self, buckets: Iterable[WeightBucket], version: int) -> int:
        return self.sender.send(buckets, version)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def __getstate__(self) -> dict:  # travels to the rank unopened
        return {**self.__dict__, "sender": None}


def group_ranks(engines: EngineServers) -> tuple[int, list[int]]:
    """(world size, rank offset of each engine) of a weight-update group: the trainer's
    source rank is 0, then every engine's TP ranks in order."""
    offsets, next_rank = [], 1
    for s in engines.servers:
        offsets.append(next_rank)
        next_rank += s.tp
    return next_rank, offsets


async def join_update_group(engines: EngineServers, address: str, port: int, name: str, backend: str,
                            timeout_s: float) -> None:
    """Every engine joins the group `name` (its rank 0 joins at the same time)."""
    world, offsets = group_ranks(engines)
    await asyncio.gather(*[engines.post(s, "/init_weights_update_group",
                                        init_group_body(address, port, offset, world, name, backend), timeout_s)
                           for s, offset in zip(engines.servers, offsets)])


LEAVE_TIMEOUT_S = 10.0  # at shutdown: an engine on a lost node must not hold the run's end


async def leave_update_group(engines: EngineServers, name: str) -> None:
    """Every engine leaves the group `name` (within LEAVE_TIMEOUT_S); one that no longer has it
    (restarted), or does not answer, is logged and left."""
    async def leave(server):
        try:
            await engines.post(server, "/destroy_weights_update_group", destroy_group_body(name), LEAVE_TIMEOUT_S)
        except (RuntimeError, httpx.HTTPError) as e:
            log.info("%s leaving update group %s: %s", server.name, name, e)
    await asyncio.gather(*[leave(s) for s in engines.servers])


class GroupTransport(WeightTransport):
    """Pipeline stages are pushed in turn: each stage's source broadcasts on a group of its
    own, and an engine serves one update request at a time, so two engines taking two
    stages' requests in different orders would each wait in the other's broadcast."""
    name = "nccl"
    stages_in_turn = True
    request_structs = {
        "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
        "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
        "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    }

    def __init__(self, cfg: Any, engines: EngineServers):
        super().__init__(cfg, engines)
        self.backend = "nccl" if cfg.cluster.gpus_per_node else default_backend()
        self.groups: list[str] = []
        self.restarts_seen = 0

    @classmethod
    def check(cls, cfg: Any, problems: Any) -> None:
        needs_engine_servers(cls, cfg, problems)
        if cfg.rollout.engine != "local" and cfg.cluster.gpus_per_node and cfg.rollout.mode == "colocated":
            problems.add("sync.transport", "nccl cannot join a trainer rank and the engine rank on the same GPU "
                         "(rollout.mode=colocated puts engines on every train GPU; NCCL refuses two ranks on one "
                         "device)", "use ipc (the colocated default) or disk")

    def connect(self, ranks: TrainRanks) -> None:
        """One group per source rank with every engine; again after an engine restart (a
        process group cannot take a new member)."""
        if self.groups and self.engines.engine_restarts == self.restarts_seen:
            return
        self._leave_all()
        world, _ = group_ranks(self.engines)
        urls = [s.url for s in self.engines.servers]
        for rank in (p.rank for p in sources(ranks)):
            name = f"megarl-sync-rank{rank}"
            address, port = ranks.free_address(rank)
            opened = ranks.open_senders({rank: GroupSender(self.backend, address, port, world, name, urls,
                                                           self.engines.api_key)})
            run_async(join_update_group(self.engines, address, port, name, self.backend,
                                          self.cfg.rollout.sglang.startup_timeout_s))
            opened()
            self.groups.append(name)
        self.restarts_seen = self.engines.engine_restarts

    def _leave_all(self) -> None:
        for name in self.groups:
            run_async(leave_update_group(self.engines, name))
        self.groups = []

    def close(self) -> None:
        self._leave_all()

    @staticmethod
    def add_engine_routes(app: Any, engine: Any) -> None:
        groups: dict[str, object] = {}  # this server's weight-update process groups by name

        @app.post("/init_weights_update_group")
        async def init_weights_update_group(request: Request):
            body = await json_body(request)
            name = str(body.get("group_name", "weight_update_group"))
            backend = str(body.get("backend", "nccl"))
            if backend == "nccl" and not torch.cuda.is_available():
                return result(False, "backend nccl needs CUDA; this engine runs on the CPU: use gloo")
            try:  # the rendezvous blocks until every rank has joined: keep the event loop free
                groups[name] = await asyncio.to_thread(
                    open_update_group, backend, str(body["master_address"]), int(body["master_port"]),
                    int(body["rank_offset"]), int(body["world_size"]), name)
            except KeyError as e:
                return result(False, f"missing field {e}")
            except (RuntimeError, ValueError, OSError) as e:
                return result(False, f"could not join update group {name}: {e}")
            return result(True, f"joined update group {name}")

        @app.post("/destroy_weights_update_group")
        async def destroy_weights_update_group(request: Request):
            name = str((await json_body(request)).get("group_name", "weight_update_group"))
            if name not in groups:
                return result(False, f"no update group {name}")
            close_update_group(groups.pop(name))
            return result(True, f"destroyed update group {name}")

        @app.post("/update_weights_from_distributed")
        async def update_weights_from_distributed(request: Request):
            if (refused := session_refusal(request, "/update_weights_from_distributed")) is not None:
                return refused
            body = await json_body(request)
            name = str(body.get("group_name", "weight_update_group"))
            if name not in groups:
                return result(False, f"no update group {name}: call /init_weights_update_group first")
            if body.get("load_format") != FLATTENED_BUCKET:
                return result(False, f"megarl's engine receives load_format={FLATTENED_BUCKET} only")
            try:
                tensors = await asyncio.to_thread(receive_bucket, groups[name], body["names"], body["dtypes"],
                                                  body["shapes"])
                await engine.update_weights([tensors], version_of(body))
            except KeyError as e:
                return result(False, f"missing field or unknown tensor {e}")
            except (RuntimeError, ValueError) as e:
                return result(False, str(e))
            return result(True, f"loaded {len(tensors)} tensors")
