"""Deadlines on the driver's calls into the run's actors: a frozen or lost part stops the run
with `ComponentDied` naming it, instead of hanging it.

Some calls may rightly take long (a training step at 32B, a 20k-token generation), so they
get no total deadline. Instead, while a call is pending, the driver pings the actor serving
it every `interval_s` and the actor must answer within `timeout_s`; actors answer pings on a
thread of their own (the "health" concurrency group), so a busy actor answers and a frozen
one (SIGSTOP, a lost node, a stuck process) does not. A generating engine must also make
progress: its ping returns the tokens it has produced so far, which must grow within
`progress_timeout_s` while generations are pending (a live engine stuck in a loop shows too).
Short calls (close, a status query) get a plain deadline. Settings: cluster.liveness
(`LivenessConfig`). Main entry points: `gather_watched`, `ActorWatch`, `bounded`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import ray

from megarl.config_cluster import LivenessConfig as Liveness
from megarl.errors import ComponentDied

log = logging.getLogger(__name__)

HEALTH_GROUP = {"health": 1}  # concurrency_groups of every actor the driver waits on


def died(what: str, error: Exception) -> ComponentDied:
    """`what` died, with the gist of Ray's error: its first line, and for an ActorDiedError (a
    first line, tab-indented fields such as "ip: ADDRESS", then the cause) the cause and the
    actor's node address (unless `what` names it already: "... on node HOST (ADDRESS)")."""
    lines = str(error).splitlines()
    fields = dict(line.strip().split(": ", 1) for line in lines[1:] if line.startswith("\t") and ": " in line)
    cause = next((line for line in lines[1:] if line.strip() and not line.startswith("\t")), "")
    gist = " ".join(filter(None, [lines[0] if lines else "", cause]))
    where = f" (on {fields['ip']})" if "ip" in fields and f"({fields['ip']})" not in what else ""
    return ComponentDied(f"{what} died{where}: {type(error).__name__}: {gist}")


def frozen(what: str, seconds: float) -> ComponentDied:
    return ComponentDied(f"{what} did not answer a health ping within {seconds:.0f} s: it is frozen or its node is "
                         "lost (cluster.liveness.timeout_s)")


def gather_watched(refs: list, actors: list, names: Callable[[int], str], liveness: Liveness,
                   keep: list[int] | None = None, peers: Sequence[tuple[object, str]] = ()) -> list:
    """Every call's result, in order (`keep`: only those refs' results, the others awaited but
    not fetched); ref i is served by actors[i], named names(i). The first failure raises
    ComponentDied naming its actor (with several calls, the others are left to be stopped); a
    pending call whose actor misses a ping raises ComponentDied too, and so does one of `peers`
    (actor, name): the parts the calls wait on in turn (the engines a weight push sends to: a
    rank blocked in a collective with a lost engine still answers its own pings)."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=liveness.interval_s)
        if not ready:
            ping_all([actors[refs.index(r)] for r in pending] + [a for a, _ in peers],
                     [names(refs.index(r)) for r in pending] + [n for _, n in peers], liveness)
            continue
        i = refs.index(ready[0])
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as e:
            raise died(names(i), e) from e
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ComponentDied):  # another part, named where it was found (e.g. the engine
                raise ComponentDied(str(e.cause)) from None  # a rank sends weights to): without Ray's traceback
            if len(refs) == 1:
                raise  # the actor's own exception (Ray's error is also an instance of it)
            raise ComponentDied(f"{names(i)} failed (the others are stopped):\n{e}") from None
    return ray.get(refs if keep is None else [refs[i] for i in keep])


def ping_all(actors: list, names: list[str], liveness: Liveness) -> None:
    """Each actor answers a ping within liveness.timeout_s, or ComponentDied names it."""
    pings = [_ping(a) for a in actors]
    ready, _ = ray.wait(pings, num_returns=len(pings), timeout=liveness.timeout_s)
    for ping, name in zip(pings, names):
        if ping not in ready:
            raise frozen(name, liveness.timeout_s)
        try:
            ray.get(ping)
        except ray.exceptions.RayActorError as e:
            raise died(name, e) from e


def _ping(actor):
    """The actor's `ping` (answered on its health thread), or, for an actor without one (a server
    launcher, idle between its rare calls), a call that only shows its process is reachable."""
    try:
        return actor.ping.remote()
    except AttributeError:
        return actor.__ray_call__.remote(lambda _: 0)


def wait_started(actors: list, names: list[str], liveness: Liveness) -> None:
    """Each actor has finished its constructor (a ping waits for it) within
    liveness.startup_timeout_s, or ComponentDied names the first that has not."""
    pings = [a.ping.remote() for a in actors]
    ready, _ = ray.wait(pings, num_returns=len(pings), timeout=liveness.startup_timeout_s)
    for ping, name in zip(pings, names):
        if ping not in ready:
            raise ComponentDied(f"{name} did not start within {liveness.startup_timeout_s:.0f} s "
                                "(cluster.liveness.startup_timeout_s)")
        try:
            ray.get(ping)
        except ray.exceptions.RayActorError as e:
            raise died(name, e) from e


class ActorWatch:
    """The async side, for one actor (the embedded engine): `wait(ref)` awaits a call into it,
    pinging while it is pending; with `generating=True` the call also needs progress (the
    actor's ping returns its produced-token count). Safe to share between concurrent waiters
    and event loops (no loop-bound state), and picklable."""

    def __init__(self, actor, name: str, liveness: Liveness):
        self.actor, self.name, self.liveness = actor, name, liveness
        self.last_ping = 0.0  # monotonic time of the newest ping sent
        self.generating = 0  # generations pending
        self.tokens = -1  # the count of the newest ping
        self.progress_at = 0.0  # when that count last grew (or generation last started from idle)

    async def wait(self, ref, generating: bool = False):
        future = asyncio.ensure_future(_awaitable(ref))
        if generating:
            if self.generating == 0:
                self.progress_at = time.monotonic()
            self.generating += 1
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=self.liveness.interval_s)
                if done:
                    try:
                        return future.result()
                    except ray.exceptions.RayActorError as e:
                        raise died(self.name, e) from e
                await self.check()
        finally:
            if not future.done():
                future.cancel()
            if generating:
                self.generating -= 1

    async def check(self) -> None:
        """One ping for all waiters per interval; ComponentDied when it goes unanswered, or
        when generations are pending and no token came for progress_timeout_s."""
        now = time.monotonic()
        if now - self.last_ping < self.liveness.interval_s:
            return
        self.last_ping = now
        try:
            tokens = await asyncio.wait_for(_awaitable(self.actor.ping.remote()), self.liveness.timeout_s)
        except asyncio.TimeoutError:
            raise frozen(self.name, self.liveness.timeout_s) from None
        except ray.exceptions.RayActorError as e:
            raise died(self.name, e) from e
        now = time.monotonic()
        if tokens != self.tokens:
            self.tokens, self.progress_at = tokens, now
        elif self.generating and now - self.progress_at > self.liveness.progress_timeout_s:
            raise ComponentDied(f"{self.name} answers but produced no token for {now - self.progress_at:.0f} s "
                                f"with {self.generating} generations pending (cluster.liveness.progress_timeout_s)")


def _awaitable(ref):
    """An ObjectRef as an asyncio future of the running loop."""
    return asyncio.wrap_future(ref.future())


async def bounded(ref, seconds: float, what: str) -> bool:
    """Await a short call (close, stop) for at most `seconds`; False (logged) when it did not
    finish or its actor is gone: the caller goes on (e.g. kills the actor)."""
    try:
        await asyncio.wait_for(_awaitable(ref), seconds)
        return True
    except asyncio.TimeoutError:
        log.warning("%s did not finish within %.0f s; going on without it", what, seconds)
    except ray.exceptions.RayError as e:
        log.debug("%s: %s", what, e)
    return False
