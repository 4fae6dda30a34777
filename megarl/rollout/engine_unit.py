"""One rollout engine's server processes, as the fleet (megarl.rollout.sglang) checks, restarts and
stops them: one `ServerProcess` (in Ray, a `ServerActor`) per node the engine spans.

An engine across nodes is SGLang's server started on each of them with the same arguments and
`--nnodes N --node-rank i --dist-init-addr ADDR` (ADDR: a free port on node rank 0's address,
where the ranks meet for torch.distributed). Node rank 0 serves the API and takes every request,
weight updates included, and hands them to the TP ranks on the other nodes; the others serve
only a health check. No rank can go on without the others, so they are one unit: the engine is
alive while every rank is, and a restart stops all of them and starts all of them again, at a
new meeting port, each at its own address (the router's worker list stays valid). An engine on
one node is a unit of one. Main entry points: `EngineUnit`, `rank_args`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

log = logging.getLogger(__name__)


def rank_args(nodes: int, rank: int, dist_init_addr: str) -> list[str]:
    """SGLang 0.5.23's arguments of node rank `rank` of an engine over `nodes` nodes; none on one."""
    if nodes == 1:
        return []
    return ["--nnodes", str(nodes), "--node-rank", str(rank), "--dist-init-addr", dist_init_addr]


class EngineUnit:
    """The ServerActors of one engine (node rank 0 first), each called as `actor.method.remote()`
    and awaited. Every method takes the engine as a whole."""

    def __init__(self, actors: Sequence):
        if not actors:
            raise ValueError("an engine has at least one server process")
        self.actors = list(actors)

    @property
    def nodes(self) -> int:
        return len(self.actors)

    async def _all(self, method: str, *args) -> list:
        return list(await asyncio.gather(*[getattr(a, method).remote(*args) for a in self.actors]))

    async def start(self, timeout_s: float) -> str:
        """Start every rank at once (they wait for each other to meet); node rank 0's URL once it
        answers, which SGLang's API does only when every rank has joined. The other ranks are
        started without a health check of their own (their ServerProcess has none) and must
        still run then."""
        meet = await self.actors[0].meeting_address.remote() if self.nodes > 1 else ""
        urls = await asyncio.gather(*[a.start.remote(timeout_s, rank_args(self.nodes, i, meet))
                                      for i, a in enumerate(self.actors)])
        gone = [i for i, ok in enumerate(await self._all("alive")) if not ok]
        if gone:
            tails = await asyncio.gather(*[self.actors[i].log_tail.remote() for i in gone])
            raise RuntimeError(f"node ranks {gone} of an engine over {self.nodes} nodes exited while it started; "
                               + "; ".join(f"the end of node rank {i}'s log:\n{t}" for i, t in zip(gone, tails)))
        return urls[0]

    async def alive(self) -> bool:
        return all(await self._all("alive"))

    async def gone_within(self, seconds: float) -> bool:
        """Whether the engine has failed, or fails within `seconds`: its API server's process is
        gone, or a rank on another node is (its API server then stalls in a collective)."""
        others = await asyncio.gather(*[a.alive.remote() for a in self.actors[1:]])
        return not all(others) or await self.actors[0].gone_within.remote(seconds)

    async def stop(self) -> None:
        """Node rank 0 first: its shutdown tells the schedulers of the other nodes to stop."""
        await self.actors[0].stop.remote()
        if self.nodes > 1:
            await self._all("stop")

    async def restart(self, timeout_s: float) -> str:
        if self.nodes == 1:
            return await self.actors[0].restart.remote(timeout_s)
        dead = [i for i, ok in enumerate(await self._all("alive")) if not ok]
        log.warning("engine of %d nodes: restarting all of them (node ranks %s were gone)", self.nodes, dead)
        await self.stop()
        return await self.start(timeout_s)

    async def log_tail(self, lines: int = 30) -> str:
        tails = await self._all("log_tail", lines)
        if self.nodes == 1:
            return tails[0]
        return "\n".join(f"--- node rank {i}:\n{tail}" for i, tail in enumerate(tails))
