"""The weight-transport interface: how the trainer's weights reach the rollout engines.

Every weight sync runs the same steps, whatever the transport (megarl.runtime.base):

    ranks.free_cache()                  train ranks return their cached device memory
    engine.begin_weight_update()        pause decoding (and get the weights' memory back)
    transport.connect(ranks)            driver: open a sender on the ranks that need one
    ranks.push(bucket_bytes, version)   every train rank exports its buckets; each rank with a
                                        sender sends them through it (one pipeline stage at a
                                        time where the transport says `stages_in_turn`)
    transport.finish(version)           driver: whatever must follow (e.g. engines load the files)
    ranks.free_cache()                  the push's buffers back to the device (also after a failure)
    engine.end_weight_update()          flush the prefix cache, KV cache back, resume decoding

A transport is one module with three sides, all in that module:
- the driver side: a `WeightTransport` subclass, built by the runtime with the engine it feeds;
- the rank side: a `WeightSender`, picklable, opened in a train rank's process, where it may
  keep state (an open process group) until the driver gives that rank another sender;
- the engine side: `add_engine_routes(app, engine)`, the HTTP routes megarl's embedded engine
  server serves for it (SGLang servers have their own);
and `check(cfg, problems)`, the transport's configuration rules. It is registered by name in
megarl/weights/__init__.py. Main entry points: `WeightTransport`, `WeightSender`, `TrainRanks`,
`EngineServers`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from megarl.weights.buckets import WeightBucket


class WeightSender(ABC):
    """The rank side of a transport: sends one source rank's buckets. Built by the driver,
    pickled to the rank, opened there once; `send` is called at every sync until the driver
    opens another sender on that rank (the old one is closed then)."""

    def open(self) -> None:
        """Connect (may block until the engines join, e.g. a process-group rendezvous)."""

    @abstractmethod
    def send(self, buckets: Iterable[WeightBucket], version: int) -> int:
        """Send every bucket of this rank (weights of `version`); returns the buckets sent."""

    def close(self) -> None:
        """Release what `open` took."""


@dataclass(frozen=True)
class RankPlace:
    """Where one train rank runs and what it holds of the exported weights."""
    rank: int
    node: str  # address of its node
    gpu: str  # the node's GPU it runs on (physical id, as CUDA_VISIBLE_DEVICES names it); "" without one
    stage: int  # its pipeline stage
    is_source: bool  # it holds its stage's full exported tensors to send (TP 0 of DP 0, CP 0)


class TrainRanks(Protocol):
    """The train worker group as a transport's driver side sees it (each runtime has one)."""

    def places(self) -> list[RankPlace]:
        """Every rank's place, by rank."""

    def free_address(self, rank: int) -> tuple[str, int]:
        """That rank's node address and a port free on it (to host a process group)."""

    def open_senders(self, senders: Mapping[int, WeightSender]) -> Callable[[], None]:
        """Give each named rank its sender and start opening it; returns a function that
        waits until every one is open (so the engines can join in between)."""

    def push(self, bucket_bytes: int, version: int, stage: int | None = None) -> int:
        """Every rank (of pipeline stage `stage` only, when given) exports its buckets (the TP
        gathers need every rank of a stage); the ranks with a sender send them through it.
        Returns the buckets sent."""

    def free_cache(self) -> None:
        """Every rank hands its allocator's cached device memory back (before colocated
        engines take theirs back)."""


def sources(ranks: TrainRanks) -> list[RankPlace]:
    """The ranks that send a pipeline stage's weights, one per stage."""
    return [p for p in ranks.places() if p.is_source]


class EngineServer(Protocol):
    """One engine server as a transport sees it."""

    name: str
    url: str
    tp: int  # GPUs (tensor-parallel ranks) of the engine
    node: str  # address of the node of its node rank 0 (the one that serves its API)
    gpus: Sequence[str]  # the GPU of each TP rank on that rank's node, in TP order (empty without GPUs)
    rank_nodes: Sequence[str]  # the node of each TP rank (several for an engine across nodes)


class EngineServers(Protocol):
    """Engine servers reached over HTTP (the SGLang fleet), as transports see them."""

    api_key: str | None  # what every request to a server carries (Authorization: Bearer); a rank's sender too

    @property
    def servers(self) -> Sequence[EngineServer]: ...

    @property
    def engine_restarts(self) -> int:
        """Engines restarted so far; a restarted engine has left every process group."""

    async def post(self, server: EngineServer, route: str, body: dict, timeout_s: float | None = None) -> dict:
        """POST a control body to one engine; raise naming the engine unless it succeeded."""

    async def post_each(self, route: str, body: dict, timeout_s: float | None = None) -> list[dict]:
        """POST `body` to every engine at once; raise naming the engine that refused."""

    async def load_from_disk(self, directory: str, version: int) -> None:
        """Every engine loads the safetensors files of `directory` (kept for restarts)."""

    async def load_adapter(self, directory: str, version: int) -> None:
        """Every engine loads PEFT's adapter directory `directory` and serves with it from now on
        (kept for restarts; the lora transport)."""


class WeightTransport(ABC):
    """The driver side of a transport. `engines`: what it feeds (an in-process or remote
    `RolloutEngine` for the inprocess transport, the fleet's `EngineServers` otherwise)."""

    name: ClassVar[str]  # the value of sync.transport that selects it
    # push one pipeline stage at a time: needed where each stage's sender holds the engines
    # in a collective of its own, which two engines could otherwise enter in different orders
    stages_in_turn: ClassVar[bool] = False
    # the engine routes it uses -> the request struct of SGLang's io_struct.py each body is
    # parsed into (checked against the pinned version by tests/test_sglang_contract.py)
    request_structs: ClassVar[dict[str, str]] = {}

    def __init__(self, cfg: Any, engines: Any):
        self.cfg, self.engines = cfg, engines
        self.connected = False

    @classmethod
    def check(cls, cfg: Any, problems: Any) -> None:
        """Add a problem (megarl.config_loader.Problems) for each setting of `cfg` (the run
        config) this transport cannot serve."""

    @staticmethod
    def add_engine_routes(app: Any, engine: Any) -> None:
        """Serve this transport's routes on megarl's embedded engine server (FastAPI `app`
        over a `RolloutEngine`); nothing by default."""

    def connect(self, ranks: TrainRanks) -> None:
        """Before a sync: make sure every rank that sends has an open sender. By default the
        senders of `senders` are opened once, for the whole run; a transport whose senders
        must be opened again (after an engine restart) overrides this."""
        if not self.connected:
            ranks.open_senders(self.senders(ranks))()
            self.connected = True

    def senders(self, ranks: TrainRanks) -> Mapping[int, WeightSender]:
        """The sender of each rank that sends (rank -> sender), for the default `connect`."""
        raise NotImplementedError(f"{type(self).__name__} keeps the default connect: it must define senders")

    def finish(self, version: int) -> None:
        """After every rank has sent: what must follow on the engines."""

    def close(self) -> None:
        """At shutdown: release what the driver side holds."""


def needs_engine_servers(cls: type[WeightTransport], cfg: Any, problems: Any) -> None:
    """The rule of every transport that talks to engine servers (rollout.engine=sglang)."""
    if cfg.rollout.engine == "local":
        problems.add("sync.transport", f"{cls.name} is for engine servers; the embedded engine takes weights in "
                     "process", "use sync.transport=auto or rollout.engine=sglang")

