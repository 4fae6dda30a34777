"""The sandbox as an HTTP service: `megarl sandbox serve`, and the client the code rewards use.

    POST /run  {"language": "python", "source": "...", "inputs": ["1 2\\n", ...], "wall_s": 5, "memory_mb": 512}
      -> {"results": [{"status": "ok", "stdout": "3\\n", "stderr": "", "exit_code": 0, "wall_s": 0.02}, ...]}
    GET /health -> {"healthy": true, "running": n, "waiting": n, "served": n}

Each request's program runs on its inputs one after another, each in a fresh local sandbox
(megarl.reward.sandbox); `max_concurrency` requests run at once, up to `max_queue` more wait,
and one more is refused at once (503, the client says so) rather than queued without bound.
A request's wall time is bounded by its inputs x wall_s (plus a compilation), and the client
waits that long plus a margin. /run needs the key when the server has one (from
$MEGARL_SANDBOX_API_KEY), and binding beyond loopback needs one.

Main entry points: `create_sandbox_app`, `serve`, `SandboxClient`.
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import asdict

import httpx
from pydantic import BaseModel, Field

from megarl.http_auth import bearer, require_api_key
from megarl.reward.sandbox import COMPILE_LIMITS, LANGUAGES, Limits, LocalSandbox, RunResult, run_cases

SANDBOX_KEY_ENV = "MEGARL_SANDBOX_API_KEY"
MAX_INPUTS = 512  # test cases in one request
MAX_SOURCE_BYTES = 1 << 20
MAX_INPUT_BYTES = 64 << 20  # all inputs of one request together


class RunRequest(BaseModel):
    language: str
    source: str = Field(max_length=MAX_SOURCE_BYTES)
    inputs: list[str] = Field(min_length=1, max_length=MAX_INPUTS)
    wall_s: float = Field(default=Limits.wall_s, gt=0, le=60)
    memory_mb: int = Field(default=Limits.memory_mb, gt=0, le=16384)


def request_deadline_s(inputs: int, wall_s: float) -> float:
    """How long one request may take at most: its cases one after another, and a compilation."""
    return inputs * (wall_s + 1.0) + COMPILE_LIMITS.wall_s + 5.0


def create_sandbox_app(sandbox: LocalSandbox, *, api_key: str | None = None, max_concurrency: int = 4,
                       max_queue: int = 64):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI(title="megarl sandbox")
    require_api_key(app, api_key, lambda path: path.startswith("/health"))
    slots = asyncio.Semaphore(max_concurrency)
    state = {"running": 0, "waiting": 0, "served": 0}  # served: requests answered

    @app.get("/health")
    async def health():
        return {"healthy": True, **state}

    @app.post("/run")
    async def run(req: RunRequest):
        if req.language not in LANGUAGES:
            return JSONResponse({"error": f"language {req.language!r}: the sandbox runs {list(LANGUAGES)}"}, 400)
        if sum(len(i) for i in req.inputs) > MAX_INPUT_BYTES:
            return JSONResponse({"error": f"the inputs exceed {MAX_INPUT_BYTES} bytes"}, 413)
        if state["waiting"] >= max_queue:
            return JSONResponse({"error": f"the sandbox queue is full ({max_queue} requests waiting)"}, 503)
        limits = Limits(wall_s=req.wall_s, cpu_s=max(1, int(req.wall_s)), memory_mb=req.memory_mb,
                        processes=sandbox.limits.processes, output_bytes=sandbox.limits.output_bytes,
                        file_mb=sandbox.limits.file_mb)
        state["waiting"] += 1
        try:
            await slots.acquire()
        finally:
            state["waiting"] -= 1
        state["running"] += 1
        try:
            results = await asyncio.to_thread(run_cases, sandbox, req.language, req.source, req.inputs, limits)
        finally:
            state["running"] -= 1
            slots.release()
        state["served"] += 1
        return {"results": [asdict(r) for r in results]}

    return app


def serve(*, host: str = "127.0.0.1", port: int = 8100, api_key: str | None = None, max_concurrency: int = 4,
          max_queue: int = 64, limits: Limits = Limits()) -> None:
    import uvicorn

    from megarl.http_server import is_loopback

    if not api_key and not is_loopback(host):
        raise ValueError(f"--host {host} can be reached from other machines: set ${SANDBOX_KEY_ENV} (the code "
                         "rewards send it) or bind 127.0.0.1; a sandbox service runs whatever code it is sent")
    sandbox = LocalSandbox(limits)
    sandbox.check()
    uvicorn.run(create_sandbox_app(sandbox, api_key=api_key, max_concurrency=max_concurrency, max_queue=max_queue),
                host=host, port=port, log_level="warning")


class SandboxClient:
    """Runs test cases on a sandbox service (reward.code_sandbox_url: one URL, or several
    separated by commas, one drawn at random per request); the key from $MEGARL_SANDBOX_API_KEY
    unless given."""

    def __init__(self, url: str, api_key: str | None = None):
        self.urls = [u.strip().rstrip("/") for u in url.split(",") if u.strip()]
        if not self.urls:
            raise ValueError(f"sandbox service URL {url!r} names no server")
        self.headers = bearer(api_key if api_key is not None else os.environ.get(SANDBOX_KEY_ENV))

    def run(self, language: str, source: str, inputs: list[str], *, wall_s: float = 5.0,
            memory_mb: int = 512) -> list[RunResult]:
        body = {"language": language, "source": source, "inputs": inputs, "wall_s": wall_s, "memory_mb": memory_mb}
        url = random.choice(self.urls)
        try:
            response = httpx.post(f"{url}/run", json=body, headers=self.headers,
                                  timeout=request_deadline_s(len(inputs), wall_s) + 10.0)
        except httpx.HTTPError as e:
            raise RuntimeError(f"sandbox service {url}: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise RuntimeError(f"sandbox service {url} answered {response.status_code}: {response.text[:300]}")
        results = response.json().get("results")
        if not isinstance(results, list) or len(results) != len(inputs):
            raise RuntimeError(f"sandbox service {url}: {len(inputs)} inputs sent, the answer has "
                               f"{len(results) if isinstance(results, list) else 'no'} results")
        return [RunResult(**r) for r in results]
