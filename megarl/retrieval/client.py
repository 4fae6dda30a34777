"""Async client of the retrieval server for the search agent: `await RetrievalClient(url).search(queries)`.

Speaks Search-R1's `POST /retrieve` API (megarl's server or Search-R1's own). A search never
raises into the agent and never hangs: every request is bounded by `timeout_s`, connection
errors, timeouts and HTTP 5xx are retried `max_retries` times with exponential backoff, and a
request that still fails comes back as `SearchResult(docs=[], error=...)` for each of its
queries (of every search that went in it: concurrent searches share the client's
`max_concurrency` requests), counted in `client.stats` so the trainer can log it. HTTP 4xx is not retried: the
request itself is wrong and sending it again cannot help. With `api_key`, every request
carries `Authorization: Bearer <api_key>`; `check_access` tells at start whether the server
takes it.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from megarl.http_auth import bearer
from megarl.http_transport import ClientPerLoop
from megarl.retrieval.documents import Document
from megarl.retrieval.retriever import check_search_args


@dataclass
class SearchResult:
    """The documents found for one query, best first; `error` says why there are none."""

    docs: list[Document] = field(default_factory=list)
    scores: list[float] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class ClientStats:
    """Counters since the client was created (or `reset()`), for the trainer's metrics."""

    requests: int = 0  # HTTP requests sent, retries included
    retries: int = 0  # of those, repeats of a failed request
    failures: int = 0  # batches given up on (after retries, or rejected with 4xx)
    failed_queries: int = 0  # queries in those batches

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def reset(self) -> None:
        self.requests = self.retries = self.failures = self.failed_queries = 0


@dataclass
class _Queue:
    """One event loop's searches: the queries waiting for a request, by topk, and the requests in flight."""

    pending: dict[int, list[tuple[str, asyncio.Future]]] = field(default_factory=dict)
    sending: set[asyncio.Task] = field(default_factory=set)


class RetrievalClient:
    """Client of one retrieval server.

    url: the server ("http://127.0.0.1:8000") or its endpoint (".../retrieve", as Search-R1 configs give it).
    timeout_s: limit of one HTTP request, connecting and reading the whole answer included.
    max_retries: repeats of a failed request; the delay before repeat n is about backoff_s * 2**(n-1)
        (between half and all of it, so that many clients do not retry in step), at most max_backoff_s.
    batch_size: queries per HTTP request at most; larger searches are split.
    max_concurrency: requests in flight at once, for all callers on an event loop together (see `search`).
    api_key: the server's key (megarl retrieval serve --api-key / $MEGARL_RETRIEVAL_API_KEY); None = none.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        batch_size: int = 512,
        max_concurrency: int = 4,
        api_key: str | None = None,
    ):
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0 or batch_size < 1 or max_concurrency < 1:
            raise ValueError(
                f"RetrievalClient needs timeout_s > 0, max_retries >= 0, backoff_s >= 0, batch_size >= 1 and "
                f"max_concurrency >= 1; got {timeout_s}, {max_retries}, {backoff_s}, {batch_size}, {max_concurrency}"
            )
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retrieval url {url!r} must start with http:// or https://, e.g. http://127.0.0.1:8000")
        base = url.rstrip("/")
        self.url = base if base.endswith("/retrieve") else base + "/retrieve"
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.batch_size = batch_size
        self.max_concurrency = max_concurrency
        self.stats = ClientStats()
        self._headers = bearer(api_key)
        # aiohttp's pool under httpx's API (megarl.http_transport), a client per event loop: a trainer
        # that calls asyncio.run() per step gets a fresh one instead of "Event loop is closed" errors
        self._http = ClientPerLoop(lambda pool: httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s),
                                                                  headers=self._headers, transport=pool))
        self._queues: dict[asyncio.AbstractEventLoop, _Queue] = {}  # each event loop's searches

    async def search(self, queries: Sequence[str], topk: int = 3) -> list[SearchResult]:
        """One SearchResult per query, in order; failures are results with an error, not exceptions.

        The searches of all callers on this event loop (the driver's) share the client's
        `max_concurrency` requests in flight: while they are all taken, new queries wait and go
        together in the next free one (up to `batch_size` a request). The agent loop searches once per trajectory, thousands at once
        at a recipe's size; one request each would cost the driver and the server a request's
        overhead per query (tools/bench/fleet_scale.py), while a lone search still goes at once."""
        check_search_args(queries, topk)
        loop = asyncio.get_running_loop()
        queue = self._queues.get(loop)
        if queue is None:  # a fresh event loop (asyncio.run per step, another thread's): its own queue
            for old in [old for old in list(self._queues) if old.is_closed()]:  # list(): another thread's may come
                self._queues.pop(old, None)
            queue = self._queues[loop] = _Queue()
        waiting = [(query, loop.create_future()) for query in queries]
        queue.pending.setdefault(topk, []).extend(waiting)
        self._send_what_fits(queue)
        return list(await asyncio.gather(*[done for _, done in waiting]))

    def _send_what_fits(self, queue: _Queue) -> None:
        """Start requests for the queued queries while fewer than max_concurrency are in flight."""
        http, _ = self._http.get()
        pending = queue.pending
        while len(queue.sending) < self.max_concurrency:
            topk = next((k for k, waiting in pending.items() if any(not d.done() for _, d in waiting)), None)
            if topk is None:
                return
            waiting = [(q, d) for q, d in pending.pop(topk) if not d.done()]  # a cancelled caller's are dropped
            batch, rest = waiting[: self.batch_size], waiting[self.batch_size:]
            if rest:
                pending[topk] = rest
            task = asyncio.ensure_future(self._answer(http, batch, topk))
            queue.sending.add(task)
            task.add_done_callback(functools.partial(self._sent, queue))

    def _sent(self, queue: _Queue, task: asyncio.Task) -> None:
        queue.sending.discard(task)
        if not task.cancelled():
            task.exception()  # handed to the searches of the request (_answer): not "never retrieved"
        if not task.get_loop().is_closed():
            self._send_what_fits(queue)

    async def _answer(self, http: httpx.AsyncClient, batch: list[tuple[str, asyncio.Future]], topk: int) -> None:
        try:
            results = await self._search_batch(http, [q for q, _ in batch], topk)
        except BaseException as e:  # cancelled, or a bug: the callers see it, nothing hangs
            for _, done in batch:
                if not done.done():
                    done.set_exception(e if isinstance(e, Exception) else asyncio.CancelledError())
            raise
        for (_, done), result in zip(batch, results):
            if not done.done():
                done.set_result(result)

    async def aclose(self) -> None:
        """Close the client of every event loop that searched."""
        await self._http.aclose()

    async def __aenter__(self) -> RetrievalClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _backoff(self, retry: int) -> float:
        delay = min(self.backoff_s * 2 ** (retry - 1), self.max_backoff_s)
        return delay * random.uniform(0.5, 1.0)

    async def _search_batch(self, http: httpx.AsyncClient, queries: list[str], topk: int) -> list[SearchResult]:
        payload = {"queries": queries, "topk": topk, "return_scores": True}
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.stats.retries += 1
                await asyncio.sleep(self._backoff(attempt))
            self.stats.requests += 1
            try:
                async with asyncio.timeout(self.timeout_s):
                    response = await http.post(self.url, json=payload)
            except TimeoutError:
                last_error = f"no answer from {self.url} within {self.timeout_s} s"
                continue
            except httpx.TransportError as e:  # connection refused or reset, read timeouts, ...
                last_error = f"{type(e).__name__} on {self.url}: {e}"
                continue
            except Exception as e:  # e.g. an invalid URL: retrying cannot help, raising would end the rollout
                return self._failed(queries, f"retrieval request to {self.url} failed: {type(e).__name__}: {e}")
            if response.status_code >= 500:
                last_error = f"HTTP {response.status_code} from {self.url}: {_detail(response)}"
                continue
            if response.status_code != 200:
                status = response.status_code
                return self._failed(queries, f"retrieval request rejected (HTTP {status}): {_detail(response)}")
            try:
                return parse_retrieve_response(response.json(), len(queries))
            except ValueError as e:  # includes JSONDecodeError
                return self._failed(queries, f"malformed answer from {self.url}: {e}")
        return self._failed(queries, f"retrieval failed after {self.max_retries} retries: {last_error}")

    def check_access(self) -> str | None:
        """At start: why the server refuses this client's key (HTTP 401 or 403 to an empty
        search, which takes no time), or None; a server that does not answer is left to the
        searches' own retries."""
        try:
            response = httpx.post(self.url, json={"queries": []}, headers=self._headers, timeout=self.timeout_s)
        except httpx.HTTPError:
            return None
        if response.status_code in (401, 403):
            return f"{self.url} answered HTTP {response.status_code}: {_detail(response)}"
        return None

    def _failed(self, queries: list[str], error: str) -> list[SearchResult]:
        self.stats.failures += 1
        self.stats.failed_queries += len(queries)
        return [SearchResult(error=error) for _ in queries]


def parse_retrieve_response(body: Any, num_queries: int) -> list[SearchResult]:
    """A /retrieve answer, with or without scores, → one SearchResult per query.

    Documents need a "contents" string; "id" is optional because Search-R1's BM25 server
    returns {"title", "text", "contents"} without one.
    """
    rows = body.get("result") if isinstance(body, dict) else None
    if not isinstance(rows, list) or len(rows) != num_queries:
        raise ValueError(f"expected {{'result': [...]}} with {num_queries} lists, got {str(body)[:200]}")
    results = []
    for row in rows:
        if not isinstance(row, list):
            raise ValueError(f"expected a list of documents per query, got {str(row)[:200]}")
        docs, scores = [], []
        for item in row:
            doc = item.get("document", item) if isinstance(item, dict) else None
            if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
                raise ValueError(f"expected a document with 'contents', got {str(item)[:200]}")
            docs.append(Document(id=str(doc.get("id", "")), contents=doc["contents"]))
            if "score" in item:
                try:
                    scores.append(float(item["score"]))
                except (TypeError, ValueError):
                    raise ValueError(f"expected a number as a document's score, got {item['score']!r}") from None
        results.append(SearchResult(docs=docs, scores=scores if len(scores) == len(docs) else None))
    return results


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
        return str(body.get("detail") or body.get("message") or response.text)[:500]
    except (ValueError, AttributeError):
        return response.text[:500]
