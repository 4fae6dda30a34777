"""The weight-transport interface: how the trainer's weights reach the rollout engines.

Every weight sync runs the same steps, whatever the transport (megarl.runtime.base):

    engine.begin_weight_update()        pause decoding (and get the weights' memory back)
    transport.connect(ranks)            driver: open a sender on each source rank, where needed
    ranks.push(bucket_bytes, version)   every train rank exports its buckets; each source rank
                                        sends them through its sender
    transport.finish(version)           driver: whatever must follow (e.g. engines load the files)
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


class TrainRanks(Protocol):
    """The train worker group as a transport's driver side sees it (each runtime has one)."""

    def sources(self) -> list[tuple[int, str]]:
        """(rank, node address) of each rank that sends a pipeline stage's weights."""

    def free_address(self, rank: int) -> tuple[str, int]:
        """That rank's node address and a port free on it (to host a process group)."""

    def open_senders(self, senders: Mapping[int, WeightSender]) -> Callable[[], None]:
        """Give each named rank its sender and start opening it; returns a function that
        waits until every one is open (so the engines can join in between)."""

    def push(self, bucket_bytes: int, version: int) -> int:
        """Every rank exports its buckets (collectives need all ranks); the source ranks send
        them through their senders. Returns the buckets sent."""


class EngineServer(Protocol):
    """One engine server as a transport sees it."""

    name: str
    url: str
    tp: int  # GPUs (tensor-parallel ranks) of the engine
    node: str  # address of the node it runs on


class EngineServers(Protocol):
    """Engine servers reached over HTTP (the SGLang fleet), as transports see them."""

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


class WeightTransport(ABC):
    """The driver side of a transport. `engines`: what it feeds (an in-process or remote
    `RolloutEngine` for the inprocess transport, the fleet's `EngineServers` otherwise)."""

    name: ClassVar[str]  # the value of sync.transport that selects it
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
        """Before a sync: make sure every source rank has an open sender. By default the
        senders of `senders` are opened once, for the whole run; a transport whose senders
        must be opened again (after an engine restart) overrides this."""
        if not self.connected:
            ranks.open_senders(self.senders(ranks))()
            self.connected = True

    def senders(self, ranks: TrainRanks) -> Mapping[int, WeightSender]:
        """The sender of each source rank (rank -> sender), for the default `connect`."""
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

