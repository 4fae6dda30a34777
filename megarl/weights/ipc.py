"""The ipc transport (colocated engines, GPUs only): the engines map the trainer's GPU memory
through CUDA IPC handles instead of copying weights over a link.

A CUDA IPC handle opens only on the GPU it was made on, and an engine's TP rank i sees only
its own GPU. So TP rank i of every engine must get a handle made by the train rank on that
same GPU, holding the whole bucket. Each bucket therefore goes, stage by stage, from its
pipeline stage's source rank to every train rank (one broadcast over the train ranks); each
rank on an engine's GPU serialises a handle of its own copy; the handles are gathered, and
the train rank on each engine's TP-0 GPU posts the list to its engine, entry i made on TP
rank i's GPU (`/update_weights_from_tensor`, SGLang's flattened bucket). Every rank keeps
its copy until every engine has answered. Main entry points: `IpcTransport`, `IpcSender`,
`SGLangHandles`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import httpx
import torch

from megarl.http_auth import bearer
from megarl.versions import SGLANG_VERSION
from megarl.weights.buckets import FlatBucket, TensorEntry, WeightBucket, flatten, split_by_dtype
from megarl.weights.group import FLATTENED_BUCKET
from megarl.weights.routes import result
from megarl.weights.transport import RankPlace, TrainRanks, WeightSender, WeightTransport, needs_engine_servers

ROUTE = "/update_weights_from_tensor"


def tensor_update_body(serialized_per_tp_rank: list[str], version: int) -> dict:
    """One flat bucket for one engine: entry i is the handle TP rank i opens."""
    return {"serialized_named_tensors": list(serialized_per_tp_rank), "load_format": FLATTENED_BUCKET,
            "weight_version": str(version), "flush_cache": False}


class HandleMaker(Protocol):
    """Makes the string an engine TP rank opens to read a flat bucket in this process's GPU
    memory (SGLangHandles on GPUs; tests use one over simulated devices)."""

    def serialize(self, bucket: FlatBucket) -> str: ...


class SGLangHandles:
    """CUDA IPC handles as SGLang reads them: the bucket's buffer and its metadata, pickled
    by SGLang's own serializer (its restricted unpickler accepts exactly that), with SGLang's
    torch patch that names a handle's device by UUID, not by a process's local index."""

    def __init__(self):
        self.serializer, self.metadata_class = sglang_ipc_api()

    def serialize(self, bucket: FlatBucket) -> str:
        metadata = [self.metadata_class(name=e.name, shape=torch.Size(e.shape), dtype=getattr(torch, e.dtype),
                                        start_idx=e.offset, end_idx=e.offset + e.nbytes, numel=e.nbytes)
                    for e in bucket.entries]
        return self.serializer.serialize({"flattened_tensor": bucket.data, "metadata": metadata}, output_str=True)


def sglang_ipc_api():
    """(MultiprocessingSerializer, FlattenedTensorMetadata) of the installed SGLang, after its
    torch patch; these are SGLang internals, so other versions are refused by name."""
    try:
        import sglang
    except ImportError:
        raise RuntimeError(f"sync.transport=ipc serialises CUDA handles with SGLang's own code, so the train ranks "
                           f"need SGLang {SGLANG_VERSION} installed too (pip install -e '.[gpu]'), or use "
                           "sync.transport=disk") from None
    found = getattr(sglang, "__version__", "unknown")
    if found != SGLANG_VERSION:
        raise RuntimeError(f"sync.transport=ipc uses SGLang internals (sglang.srt.utils.MultiprocessingSerializer, "
                           f"sglang.srt.utils.patch_torch, sglang.srt.weight_sync.tensor_bucket) as of SGLang "
                           f"{SGLANG_VERSION}; this environment has {found}: install {SGLANG_VERSION} or use "
                           "sync.transport=nccl or disk")
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    if torch.cuda.is_available():  # the patch names CUDA devices by UUID; it cannot pickle a CPU tensor
        monkey_patch_torch_reductions()
    return MultiprocessingSerializer, FlattenedTensorMetadata


class IpcSender(WeightSender):
    """One train rank's end (every rank has one: every rank takes part in the broadcasts).

    `places`: every train rank's place; `rank`: this one; `leads`: the engines whose TP-0 GPU
    is this rank's, each (url, the train rank on the GPU of each of its TP ranks);
    `makes_handle`: an engine TP rank runs on this rank's GPU; `api_key`: what the engines require."""

    def __init__(self, places: Sequence[RankPlace], rank: int, leads: Sequence[tuple[str, list[int]]],
                 makes_handle: bool, handles: HandleMaker | None = None, timeout_s: float = 600.0,
                 api_key: str | None = None):
        self.rank, self.leads, self.makes_handle, self.timeout_s = rank, [tuple(x) for x in leads], makes_handle, timeout_s
        self.api_key = api_key
        self.stage = places[rank].stage
        self.source_of = {p.stage: p.rank for p in places if p.is_source}
        self.handles = handles

    def open(self) -> None:
        if self.handles is None and self.makes_handle:
            self.handles = SGLangHandles()

    def send(self, buckets: Iterable[WeightBucket], version: int) -> int:
        count = 0
        with httpx.Client(timeout=self.timeout_s, headers=bearer(self.api_key)) as client:
            for stage in sorted(self.source_of):
                mine = iter(buckets) if stage == self.stage else None
                for flat in self._stage_buckets(self.source_of[stage], mine):
                    self._hand_over(client, flat, version)
                    count += 1
        return count

    def _stage_buckets(self, source: int, mine: Iterator[WeightBucket] | None) -> Iterator[FlatBucket]:
        """The stage's buckets, one dtype each, on every rank. The other ranks of the stage
        advance their own export in step with its source (the TP gathers are collectives)."""
        while True:
            bucket = next(mine, None) if mine is not None else None
            pieces = [flatten(p, packed=True) for p in split_by_dtype(bucket)] if bucket and self.rank == source else []
            manifest = _broadcast_object([p.entries for p in pieces] if bucket is not None else None, source)
            if manifest is None:
                return
            for i, entries in enumerate(manifest):
                yield _broadcast_bucket(pieces[i] if pieces else None, entries, source)

    def _hand_over(self, client, flat: FlatBucket, version: int) -> None:
        """Every rank on an engine GPU makes a handle to its copy; each lead rank posts its
        engines their handles; every rank learns of any failure (and keeps its copy alive
        until then)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copy is complete before another process reads it
        handle = self.handles.serialize(flat) if self.makes_handle else None
        handles = _all_gather_object(handle)
        error = None
        for url, tp_ranks in self.leads:
            try:
                response = client.post(url + ROUTE, json=tensor_update_body([handles[r] for r in tp_ranks], version))
                if response.status_code != 200 or not response.json().get("success"):
                    error = (f"{url} failed to load a weight bucket through CUDA IPC: "
                             f"{response.status_code} {response.text[:500]}")
            except (httpx.HTTPError, ValueError) as e:
                error = f"{url} did not answer a CUDA IPC weight update: {e}"
        failures = [e for e in _all_gather_object(error) if e]
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # nothing of this rank still uses the buffer it frees next
        if failures:
            raise RuntimeError(failures[0])


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def _broadcast_object(obj: Any, source: int) -> Any:
    if not _distributed():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=source)
    return box[0]


def _all_gather_object(obj: Any) -> list:
    if not _distributed():
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _broadcast_bucket(mine: FlatBucket | None, entries: list[TensorEntry], source: int) -> FlatBucket:
    """The source's flat bucket on every rank, in this rank's device memory."""
    if not _distributed():
        return mine
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if torch.distributed.get_rank() == source:
        data = mine.data.to(device)
    else:
        data = torch.empty(sum(e.nbytes for e in entries), dtype=torch.uint8, device=device)
    torch.distributed.broadcast(data, src=source)
    return FlatBucket(data, list(entries))


def ipc_plan(places: Sequence[RankPlace], servers: Iterable[Any]) -> tuple[dict[int, list], set[int]]:
    """(engines each train rank posts to, as (url, train rank of each TP rank); the train
    ranks that make handles). An engine TP rank without a train rank on its GPU is refused:
    CUDA IPC hands memory only to a process on the same GPU."""
    on_gpu = {(p.node, p.gpu): p.rank for p in places if p.gpu}
    leads: dict[int, list] = {p.rank: [] for p in places}
    makers: set[int] = set()
    for server in servers:
        if len(server.gpus) != server.tp:
            raise RuntimeError(f"sync.transport=ipc: engine {server.name} has {server.tp} TP ranks but "
                               f"{len(server.gpus)} known GPUs; CUDA IPC needs engines on GPUs (rollout.mode=colocated)")
        tp_ranks = []
        for i, (node, gpu) in enumerate(zip(server.rank_nodes, server.gpus)):
            rank = on_gpu.get((node, gpu))
            if rank is None:
                raise RuntimeError(f"sync.transport=ipc: TP rank {i} of engine {server.name} runs on GPU {gpu} of "
                                   f"node {node}, where no train rank runs; a CUDA IPC handle opens only on "
                                   "the GPU it was made on. Put the engines on the train GPUs (rollout.mode="
                                   "colocated) or use sync.transport=nccl or disk")
            tp_ranks.append(rank)
        leads[tp_ranks[0]].append((server.url, tp_ranks))
        makers.update(tp_ranks)
    return leads, makers


class IpcTransport(WeightTransport):
    name = "ipc"
    request_structs = {ROUTE: "UpdateWeightsFromTensorReqInput"}

    @classmethod
    def check(cls, cfg: Any, problems: Any) -> None:
        needs_engine_servers(cls, cfg, problems)
        if cfg.rollout.engine == "local":
            return
        if not cfg.cluster.gpus_per_node:
            problems.add("sync.transport", "ipc passes CUDA memory and needs GPUs", "use nccl or disk")
        elif cfg.rollout.mode == "disaggregated":
            problems.add("sync.transport", "ipc needs the engines on the trainer's GPUs (rollout.mode=colocated)",
                         "use nccl or disk")

    def senders(self, ranks: TrainRanks) -> dict[int, WeightSender]:
        places = ranks.places()
        leads, makers = ipc_plan(places, self.engines.servers)
        return {p.rank: IpcSender(places, p.rank, leads[p.rank], p.rank in makers, api_key=self.engines.api_key)
                for p in places}

    @staticmethod
    def add_engine_routes(app: Any, engine: Any) -> None:
        @app.post(ROUTE)
        async def update_weights_from_tensor():
            return result(False, "update_weights_from_tensor passes CUDA IPC handles, which megarl's embedded engine "
                                 "does not take: use sync.transport=nccl or disk")
