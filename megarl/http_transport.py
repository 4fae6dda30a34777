"""httpx requests over aiohttp's connection pool, for clients with thousands of requests in flight.

A rollout fleet sends every trajectory's turn as one long /generate request (a recipe's batch:
8,000 at once through the router). httpx's own pool (httpcore 1.0) scans all its connections
and every queued request at each request and answer, which grows with the square of the
requests in flight: at 8,000 the driver spent all its time there (tools/bench/fleet_scale.py,
docs/benchmarks.md); and its default limit of 100 connections held the fleet to 100 requests in
flight. aiohttp's pool takes a free connection of the host in constant time, with no limit.
Callers keep httpx's API, timeouts and errors: aiohttp's are raised as httpx's (a lost
connection as httpx.TransportError, which the fleet retries). Main entry points: `PooledTransport`,
and `ClientPerLoop`, which gives each event loop its own client and closes every session it made.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import aiohttp
import httpx

log = logging.getLogger(__name__)

# set by the session per connection: an explicit one would conflict with aiohttp's own
_OWN_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding"})
# an idle connection is reused for this long only: less than the 5 s after which uvicorn (the
# retrieval server's, SGLang's) closes one, so a request never goes out on a connection the
# server is closing (a POST that fails there is not retried by aiohttp). aiohttp takes the oldest
# idle connection first, so with thousands open most are older than that and new ones are made:
# a server known to keep them longer is given a longer time (sglang-router: ROUTER_KEEPALIVE_S)
KEEPALIVE_S = 4.0
ROUTER_KEEPALIVE_S = 55.0  # sglang-router 0.3.2 answered on a connection idle 66 s
CLOSE_TIMEOUT_S = 10.0  # closing a session on another thread's loop waits this long at most


class PooledTransport(httpx.AsyncBaseTransport):
    """An httpx transport over one aiohttp session (made in the event loop of the first request;
    one transport per event loop, as an httpx client is)."""

    def __init__(self, keepalive_s: float = KEEPALIVE_S):
        self._session: aiohttp.ClientSession | None = None
        self._guard = None  # closes the session when its loop ends (_closed_at_loop_end)
        self.keepalive_s = keepalive_s  # how long an idle connection is reused (KEEPALIVE_S)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in _OWN_HEADERS]
        status, answer_headers, body = await self.send(request.method, str(request.url), headers,
                                                       await request.aread() or None, timeout.get("connect"),
                                                       timeout.get("read"), request)
        return httpx.Response(status, headers=answer_headers, content=body, request=request)

    async def send(self, method: str, url: str, headers, body: bytes | None, connect_s: float | None,
                   read_s: float | None, request: httpx.Request | None = None) -> tuple[int, list, bytes]:
        """One request straight on the pool, without httpx's request and response objects (half
        a /generate call's client time): (status, headers, body). Its deadlines are httpx's:
        `connect_s` to connect (name resolution included), `read_s` between two reads of the
        answer; aiohttp has none for writing the body (httpx's write timeout), which the bodies
        sent here (token ids, control bodies, search queries) do not need: they go into the
        socket's buffer at once. Errors are httpx's, and name the method and URL."""
        if self._session is None:
            # bodies are passed on as they came (httpx decodes them); no limit on connections
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
            self._guard = _closed_at_loop_end(self._session)
            await self._guard.__anext__()
        limits = aiohttp.ClientTimeout(total=None, connect=connect_s, sock_connect=connect_s, sock_read=read_s)
        try:
            async with self._session.request(method, url, headers=headers, data=body, timeout=limits,
                                             allow_redirects=False) as answer:
                return answer.status, list(answer.raw_headers), await answer.read()
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            raise _as_httpx_error(e, request or httpx.Request(method, url), connect_s, read_s) from e

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
            await self._guard.aclose()

    def detach(self) -> None:
        """Let go of a session whose event loop is closed, which can run nothing more (not even
        the session's close): it and its connector are marked closed, without aiohttp's
        "Unclosed client session" and "Unclosed connector" warnings."""
        session, self._session = self._session, None
        if session is None or session.closed:
            return
        connector = session.connector
        session.detach()
        # on a closed loop, the connector's close awaits nothing: its first step marks it closed
        steps = connector.close().__await__()
        try:
            next(steps)
        except StopIteration:
            pass
        else:
            steps.close()


def _as_httpx_error(error: Exception, request: httpx.Request, connect_s: float | None,
                    read_s: float | None) -> httpx.TransportError:
    """aiohttp's `error` as the httpx error httpx would have raised for `request` (a lost
    connection or a deadline: a TransportError, which the fleet re-sends), naming it."""
    where = f"{request.method} {request.url}"
    if isinstance(error, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(f"{where}: no connection within {connect_s} s", request=request)
    if isinstance(error, asyncio.TimeoutError):
        return httpx.ReadTimeout(f"{where}: no answer within {read_s} s", request=request)
    if isinstance(error, aiohttp.ClientConnectorError):
        return httpx.ConnectError(f"{where}: {error}", request=request)
    kind = httpx.RemoteProtocolError if isinstance(
        error, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)) else httpx.NetworkError
    return kind(f"{where}: {str(error) or type(error).__name__}", request=request)


async def _closed_at_loop_end(session: aiohttp.ClientSession):
    """Closes `session` when its event loop ends: asyncio.run (a trainer's step, a test) finalizes
    the async generators left open before it closes the loop, and a session it did not close would
    be left to the garbage collector (aiohttp's "Unclosed client session" error)."""
    try:
        yield
    finally:
        await session.close()


class ClientPerLoop:
    """The running event loop's httpx client, made by `make_client(transport)` over a transport of
    `make_transport()`: a connection belongs to the loop that opened it, and the trainer may run
    its rollouts in more than one (asyncio.run per step, threads of their own). A client of a loop
    that has closed is let go when a new loop comes (its session closed itself at the loop's end,
    or is detached); `aclose` closes every client on its own loop."""

    def __init__(self, make_client: Callable[[httpx.AsyncBaseTransport], httpx.AsyncClient],
                 make_transport: Callable[[], httpx.AsyncBaseTransport] = PooledTransport):
        self.make_client, self.make_transport = make_client, make_transport
        self._by_loop: dict[asyncio.AbstractEventLoop, tuple[httpx.AsyncClient, httpx.AsyncBaseTransport]] = {}
        self._lock = threading.Lock()  # loops on two threads may come at once

    def get(self) -> tuple[httpx.AsyncClient, httpx.AsyncBaseTransport]:
        """(client, its transport) of the running loop."""
        loop = asyncio.get_running_loop()
        found = self._by_loop.get(loop)
        if found is None:
            with self._lock:
                for old in [old for old in self._by_loop if old.is_closed()]:
                    _detach(self._by_loop.pop(old)[1])
                transport = self.make_transport()
                found = self._by_loop[loop] = (self.make_client(transport), transport)
        return found

    async def aclose(self) -> None:
        """Close each loop's client on that loop: this one's here, a running one's in its thread
        (waited for, CLOSE_TIMEOUT_S at most), a stopped one's when it next runs; a closed
        one's is detached."""
        here = asyncio.get_running_loop()
        with self._lock:
            by_loop, self._by_loop = self._by_loop, {}
        for loop, (client, transport) in by_loop.items():
            if loop is here:
                await client.aclose()
            elif loop.is_closed():
                _detach(transport)
            elif loop.is_running():
                closing = asyncio.run_coroutine_threadsafe(client.aclose(), loop)
                try:
                    await asyncio.wait_for(asyncio.wrap_future(closing), CLOSE_TIMEOUT_S)
                except asyncio.TimeoutError:  # that loop is stuck: a close must not hang the caller's shutdown
                    log.warning("an HTTP client's event loop (on another thread) did not close it within %.0f s",
                                CLOSE_TIMEOUT_S)
            else:
                loop.call_soon_threadsafe(lambda c=client, l=loop: l.create_task(c.aclose()))


def _detach(transport: httpx.AsyncBaseTransport) -> None:
    if isinstance(transport, PooledTransport):
        transport.detach()
