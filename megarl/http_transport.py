"""httpx requests over aiohttp's connection pool, for clients with thousands of requests in flight.

A rollout fleet sends every trajectory's turn as one long /generate request (a recipe's batch:
8,000 at once through the router). httpx's own pool (httpcore 1.0) scans all its connections
and every queued request at each request and answer, which grows with the square of the
requests in flight: at 8,000 the driver spent all its time there (tools/bench/fleet_scale.py,
docs/benchmarks.md); and its default limit of 100 connections held the fleet to 100 requests in
flight. aiohttp's pool takes a free connection of the host in constant time, with no limit.
Callers keep httpx's API, timeouts and errors: aiohttp's are raised as httpx's (a lost
connection as httpx.TransportError, which the fleet retries). Main entry point: `PooledTransport`.
"""

from __future__ import annotations

import asyncio

import aiohttp
import httpx

# set by the session per connection: an explicit one would conflict with aiohttp's own
_OWN_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding"})
# an idle connection is reused for this long only: less than the 5 s after which uvicorn (the
# retrieval server's, SGLang's) closes one, so a request never goes out on a connection the
# server is closing (a POST that fails there is not retried by aiohttp). aiohttp takes the oldest
# idle connection first, so with thousands open most are older than that and new ones are made:
# a server known to keep them longer is given a longer time (sglang-router: ROUTER_KEEPALIVE_S)
KEEPALIVE_S = 4.0
ROUTER_KEEPALIVE_S = 55.0  # sglang-router 0.3.2 answered on a connection idle 66 s


class PooledTransport(httpx.AsyncBaseTransport):
    """An httpx transport over one aiohttp session (made in the event loop of the first request;
    one transport per event loop, as an httpx client is)."""

    def __init__(self, keepalive_s: float = KEEPALIVE_S):
        self._session: aiohttp.ClientSession | None = None
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
        a /generate call's client time): (status, headers, body); errors as httpx's."""
        if self._session is None:
            # bodies are passed on as they came (httpx decodes them); no limit on connections
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        limits = aiohttp.ClientTimeout(total=None, sock_connect=connect_s, sock_read=read_s)
        try:
            async with self._session.request(method, url, headers=headers, data=body, timeout=limits,
                                             allow_redirects=False) as answer:
                return answer.status, list(answer.raw_headers), await answer.read()
        except asyncio.TimeoutError as e:
            raise httpx.ReadTimeout(f"no answer within the timeout: {e!r}", request=request) from e
        except aiohttp.ClientConnectorError as e:
            raise httpx.ConnectError(str(e), request=request) from e
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as e:
            raise httpx.RemoteProtocolError(str(e) or type(e).__name__, request=request) from e
        except aiohttp.ClientError as e:
            raise httpx.NetworkError(str(e) or type(e).__name__, request=request) from e

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
