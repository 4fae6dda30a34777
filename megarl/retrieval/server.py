"""HTTP retrieval server with Search-R1's API: `create_app(retriever)`, `serve(...)`.

    POST /retrieve  {"queries": [str, ...], "topk": k (optional), "return_scores": bool (optional)}
      → {"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}   with return_scores
      → {"result": [[{"id", "contents"}, ...], ...]}                            without (the default)
    GET /health     → {"status": "ok", "kind": ..., "num_docs": ...}

The same shapes as search_r1/search/retrieval_server.py, so clients of either server work
with both, and the same requests are taken: `{"queries": []}` (what Search-R1's generation
loop posts when no trajectory of a turn searched) answers `{"result": []}`; a topk that is
missing, null or 0 means the server's default; topk and return_scores are read as Search-R1's
pydantic model reads them (lax mode: topk "3" or 3.0; return_scores 1 / 0, "true", "False",
"yes", "off", ...). Where megarl differs, it refuses, with HTTP 422 and the reason, requests
that the reference would serve or fail on later: more than max_topk documents or max_queries
queries, a negative topk (a search error there). And a null return_scores means the default
here, where Search-R1 refuses it.

With an API key (`create_app(..., api_key=)`, `megarl retrieval serve` with
$MEGARL_RETRIEVAL_API_KEY or --api-key), /retrieve requires `Authorization: Bearer <key>`
(401 otherwise) and /health stays open. Search-R1's own client sends no key, so a key is
optional on loopback; bound to any other address, `serve` refuses to start without one
unless told `allow_unauthenticated` (`check_bind`).

All queries of a request are searched in one batched call, in a worker thread so the event
loop (and /health) stays responsive. `BackgroundServer` (megarl.http_server) runs the app in a
thread of the current process: an in-process retriever for CPU runs, and the tests' real HTTP
server.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from megarl.http_auth import require_api_key
from megarl.http_server import BackgroundServer, is_loopback  # BackgroundServer: part of megarl.retrieval's API
from megarl.retrieval.errors import RetrievalError
from megarl.retrieval.retriever import Retriever

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOPK = 100
# Search-R1 sends every active trajectory's query of a turn in one request: 512 prompts x 5
# samples = 2,560 queries. Larger requests are refused rather than tying up the server.
DEFAULT_MAX_QUERIES = 4096
# Search-R1's request model declares `topk: Optional[int]` and `return_scores: bool`; pydantic's
# own validators of those types take exactly the values it takes.
_LAX_INT = TypeAdapter(int)
_LAX_BOOL = TypeAdapter(bool)


@dataclass(frozen=True)
class RetrieveRequest:
    queries: list[str]
    topk: int
    return_scores: bool


class RequestError(ValueError):
    """A malformed /retrieve request; the message is sent back to the client (HTTP 422)."""


def parse_retrieve_request(
    body: Any, *, default_topk: int, max_topk: int = DEFAULT_MAX_TOPK, max_queries: int = DEFAULT_MAX_QUERIES
) -> RetrieveRequest:
    """Validate a decoded /retrieve body; RequestError says which field is wrong and why."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object with a 'queries' list, got a JSON {_json_type(body)}")
    if "queries" not in body:
        raise RequestError(f"the body has no 'queries' list (it has {sorted(body) or 'no fields'})")
    queries = body["queries"]
    if not isinstance(queries, list):
        raise RequestError(f"'queries' must be a list of strings, got {_json_type(queries)}")
    if len(queries) > max_queries:
        raise RequestError(f"{len(queries)} queries in one request; this server takes at most {max_queries}, split it")
    for i, query in enumerate(queries):
        if not isinstance(query, str):
            raise RequestError(f"queries[{i}] must be a string, got {_json_type(query)}")
    topk = body.get("topk")
    if topk is not None:
        topk = _lax(_LAX_INT, topk, "'topk' must be an integer")
    if not topk:  # missing, null or 0, as Search-R1's `if not request.topk`
        topk = default_topk
    elif not 1 <= topk <= max_topk:
        raise RequestError(f"'topk' must be between 1 and {max_topk}, got {topk}")
    return_scores = body.get("return_scores")
    if return_scores is None:
        return_scores = False
    else:
        return_scores = _lax(
            _LAX_BOOL, return_scores, "'return_scores' must be true or false (also 1 / 0 or a string such as \"true\", "
            "\"no\", \"on\")"
        )
    return RetrieveRequest(queries=queries, topk=topk, return_scores=return_scores)


def create_app(
    retriever: Retriever,
    default_topk: int = 3,
    *,
    max_topk: int = DEFAULT_MAX_TOPK,
    max_queries: int = DEFAULT_MAX_QUERIES,
    max_concurrent_searches: int = 4,
    api_key: str | None = None,
) -> FastAPI:
    """A FastAPI app serving `retriever` (see the module docstring for the API).

    default_topk: documents per query when a request has no topk.
    max_topk, max_queries: larger requests get HTTP 422.
    max_concurrent_searches: requests searched at once; more wait their turn.
    api_key: required (Authorization: Bearer) on every route but /health; None = no key.
    """
    app = FastAPI(title="megarl retrieval", docs_url=None, redoc_url=None)
    require_api_key(app, api_key, lambda path: path == "/health")
    limiter: list[anyio.CapacityLimiter] = []  # created on first use: it belongs to the server's loop

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "kind": retriever.kind, "num_docs": len(retriever)}

    @app.post("/retrieve")
    async def retrieve(request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"the body is not valid JSON ({e})")
        try:
            req = parse_retrieve_request(body, default_topk=default_topk, max_topk=max_topk, max_queries=max_queries)
        except RequestError as e:
            return _error(422, str(e))
        if not req.queries:
            return JSONResponse({"result": []})
        if not limiter:
            limiter.append(anyio.CapacityLimiter(max_concurrent_searches))
        try:
            hits = await anyio.to_thread.run_sync(
                retriever.search, req.queries, req.topk, True, limiter=limiter[0]
            )
        except Exception as e:
            logger.exception("search of %d queries failed", len(req.queries))
            return _error(500, f"search failed: {type(e).__name__}: {e}")
        if req.return_scores:
            result = [[{"document": doc.to_dict(), "score": score} for doc, score in row] for row in hits]
        else:
            result = [[doc.to_dict() for doc, _ in row] for row in hits]
        return JSONResponse({"result": result})

    return app


def serve(
    retriever: Retriever,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    default_topk: int = 3,
    log_level: str = "info",
    api_key: str | None = None,
    allow_unauthenticated: bool = False,
    **app_options: Any,
) -> None:
    """Serve `retriever` over HTTP until interrupted (binds localhost unless told otherwise);
    `check_bind` first."""
    check_bind(host, api_key, allow_unauthenticated)
    uvicorn.run(create_app(retriever, default_topk, api_key=api_key, **app_options), host=host, port=port,
                log_level=log_level)


def check_bind(host: str, api_key: str | None, allow_unauthenticated: bool = False) -> None:
    """RetrievalError unless the server may bind `host`: anything beyond loopback needs a key
    (or the explicit choice to serve anyone who reaches the port)."""
    if api_key or allow_unauthenticated or is_loopback(host):
        return
    raise RetrievalError(
        f"--host {host} can be reached from other machines, and without a key anyone who reaches the port can use "
        f"this server: set $MEGARL_RETRIEVAL_API_KEY (megarl's retrieval client sends it as 'Authorization: Bearer', "
        f"from the same variable or agent.retrieval.api_key), or pass --allow-unauthenticated (Search-R1's own "
        f"client sends no key), or bind 127.0.0.1")


def _lax(adapter: TypeAdapter, value: Any, expected: str) -> Any:
    """`value` read by pydantic's lax validator; RequestError saying `expected` and the value otherwise."""
    try:
        return adapter.validate_python(value)
    except ValidationError:
        raise RequestError(f"{expected}, got {_json_type(value)} {value!r}") from None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
