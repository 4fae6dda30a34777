"""SGLang's native HTTP API, both ways: serve any engine with it, and use any server that
speaks it as a `RolloutEngine`.

`create_engine_app(engine)` serves an engine (the embedded one: `python -m
megarl.rollout.serve`, the CPU fleet and CI) with the pinned SGLang version's routes and
payloads (`megarl.rollout.sglang_api`): `/generate`, `/health`, `/health_generate`,
`/flush_cache`, `/pause_generation` (retract), `/continue_generation`, memory release and
resume, `/get_model_info`, `/get_server_info`, megarl's own `/weight_checksums`, and the
weight routes of every transport (each served by its module in megarl.weights). Given an
API key, every route but the health checks requires it, as SGLang's `--api-key` does.
`HTTPEngine(url)` is the client the SGLang fleet uses for each server; CI runs it against
the embedded server, and tests/test_sglang_contract.py checks its bodies against SGLang's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from collections.abc import Iterable
from dataclasses import replace

import httpx
import orjson
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from megarl.http_auth import bearer, require_api_key
from megarl.rollout import sglang_api
from megarl.rollout.engine import PREEMPTED, GenerationOutput, PauseAroundUpdates, RolloutEngine, SamplingParams
from megarl.http_transport import KEEPALIVE_S, ClientPerLoop, PooledTransport
from megarl.weights import adapters, all_transports, disk
from megarl.weights.buckets import WeightBucket
from megarl.weights.routes import json_body, result

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 120.0  # one probe sequence's prefill on a loaded engine takes well under a second


def create_engine_app(engine: RolloutEngine, tokenizer=None, model_path: str = "",
                      api_key: str | None = None) -> FastAPI:
    """The engine behind SGLang's routes; with `api_key`, a request to any route but those
    SGLang leaves open (sglang_api.open_without_key) needs `Authorization: Bearer <api_key>`."""
    app = FastAPI(title="megarl engine (SGLang-compatible API)")
    require_api_key(app, api_key, sglang_api.open_without_key)

    async def one(ids, params: dict | None, return_logprob: bool, routed_from: int | None,
                  logprob_start: int) -> dict:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise HTTPException(400, "input_ids must be a non-empty list of token ids (or a list of such lists)")
        try:
            sampling = replace(SamplingParams.from_sglang(params), routed_experts_from=routed_from)
        except (ValueError, TypeError) as e:
            raise HTTPException(400, f"bad sampling_params: {e}")
        try:
            out = await engine.generate(ids, sampling)
        except ValueError as e:  # a request the engine cannot serve (routed experts it does not record)
            raise HTTPException(400, str(e))
        text = tokenizer.decode(out.token_ids) if tokenizer is not None else ""
        answer = sglang_api.output_to_sglang(out, return_logprob, text)
        if return_logprob and logprob_start == 0:  # the prompt's log-probs too, unscaled as SGLang's (the probe)
            answer["meta_info"]["input_token_logprobs"] = sglang_api.prompt_log_probs_to_sglang(
                ids, await engine.prompt_log_probs(ids))
        return answer

    @app.post("/generate")
    async def generate(body: dict):
        if "text" in body and "input_ids" not in body:
            raise HTTPException(400, "megarl engines take input_ids, not text (tokens in, tokens out)")
        ids, params = body.get("input_ids"), body.get("sampling_params")
        return_logprob = bool(body.get("return_logprob", False))
        logprob_start = body.get("logprob_start_len", -1)
        if logprob_start not in (-1, 0):
            raise HTTPException(400, "megarl's engine returns the prompt's log-probs from its first token only "
                                     "(logprob_start_len 0) or none (-1)")
        routed_from = None
        if body.get("return_routed_experts"):
            routed_from = body.get("routed_experts_start_len", 0)
            if not isinstance(routed_from, int) or isinstance(routed_from, bool):
                raise HTTPException(400, "routed_experts_start_len must be one integer")
        if isinstance(ids, list) and ids and isinstance(ids[0], list):  # a batch
            per_item = params if isinstance(params, list) else [params] * len(ids)
            if len(per_item) != len(ids):
                raise HTTPException(400, f"{len(per_item)} sampling_params for {len(ids)} prompts")
            return await asyncio.gather(*[one(i, p, return_logprob, routed_from, logprob_start)
                                          for i, p in zip(ids, per_item)])
        return await one(ids, params, return_logprob, routed_from, logprob_start)

    @app.get("/health")
    async def health():
        if not await engine.health():
            return JSONResponse({"healthy": False}, status_code=503)
        return {"healthy": True}

    @app.get("/health_generate")
    async def health_generate():
        out = await engine.generate([0], SamplingParams(max_new_tokens=1, temperature=0.0))
        if out.finish_reason == "abort":
            return JSONResponse({"healthy": False, "message": out.message}, status_code=503)
        return {"healthy": True}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        return {"model_path": model_path, "engine": "megarl-embedded", "weight_version": str(engine.weight_version)
                if hasattr(engine, "weight_version") else "0"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        await engine.flush_cache()
        return {"success": True}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        if not (await json_body(request)).get("abort_all"):
            return JSONResponse({"message": "megarl's engine aborts all requests only (abort_all: true)",
                                 "status": "error"}, status_code=400)
        await engine.abort_requests()
        return {"success": True}

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        mode = (await json_body(request)).get("mode", "abort")
        if mode not in ("retract", "in_place"):
            return JSONResponse({"message": f"mode {mode!r}: megarl's engine pauses without aborting requests "
                                 "(use retract or in_place)", "status": "error"}, status_code=400)
        await engine.pause()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await json_body(request)
        await engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    # SGLang's weight-update session: the routes of sglang_api.SESSION_REQUIRED_ROUTES refuse
    # outside it (megarl.weights.routes.session_refusal), as SGLang 0.5.23's do
    app.state.weight_update_session = False

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        await json_body(request)
        if app.state.weight_update_session:
            return result(False, f"{sglang_api.SESSION_OPEN}; call end_weight_update() first")
        app.state.weight_update_session = True
        return result(True, "Success")

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        await json_body(request)
        if not app.state.weight_update_session:
            return result(False, f"{sglang_api.NO_SESSION}; call begin_weight_update() first")
        app.state.weight_update_session = False
        return result(True, "Success")

    @app.get("/weight_checksums")  # megarl's own route (sync.verify); SGLang has none
    async def checksums():
        return await engine.weight_checksums()

    for route, method in (("/release_memory_occupation", "release_memory"),
                          ("/resume_memory_occupation", "resume_memory")):
        app.add_api_route(route, _caller(engine, method), methods=["GET", "POST"])
    for transport in all_transports():  # the weight routes: each transport serves its own
        transport.add_engine_routes(app, engine)
    return app


def _caller(engine, method: str):
    async def call():
        await getattr(engine, method)()
        return {"success": True}
    return call


class ServerError(RuntimeError):
    """The server answered a request with an error status."""

    def __init__(self, url: str, status: int, text: str):
        super().__init__(f"{url} answered {status}: {text[:500]}")
        self.status = status


def _loads(text: bytes):
    """A /generate answer's JSON: orjson (thousands of answers a second; against json:
    `python tools/bench/codecs.py`), or json where the text has what only json reads (NaN, Infinity)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


class HTTPEngine(PauseAroundUpdates):
    """A `RolloutEngine` backed by a server speaking SGLang's native API.

    `update_weights` takes buckets in this process and sends them through `weight_dir`
    (storage the server can read): each bucket a safetensors file, then one
    `/update_weights_from_disk`. The fleet's other transports use `post`. Every request
    carries `api_key` (the server's --api-key), when given. `transport`: an httpx transport
    of its own instead of aiohttp's pool (tests' mock transports).
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, weight_dir: str | None = None,
                 api_key: str | None = None, keepalive_s: float = KEEPALIVE_S,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        self.keepalive_s = keepalive_s  # how long an idle connection is reused (megarl.http_transport)
        self.timeout_s = timeout_s
        self.weight_dir = weight_dir
        self._headers = bearer(api_key)
        # each event loop's client: the trainer may run rollouts in a fresh loop (asyncio.run), and
        # a connection belongs to the loop that opened it. Its connections are aiohttp's pool
        # (megarl.http_transport): thousands of requests in flight at once
        self._http = ClientPerLoop(
            lambda pool: httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s, headers=self._headers,
                                           transport=pool),
            (lambda: transport) if transport is not None else (lambda: PooledTransport(self.keepalive_s)))
        self._json_headers = {**self._headers, "content-type": "application/json"}
        self.adapter: str | None = None  # the LoRA adapter every request is served with (the lora transport)
        self._in_flight: set[int] = set()  # ids of the generate calls waiting for an answer
        self._preempted: set[int] = set()  # those in flight when abort_requests came

    @property
    def _client(self) -> httpx.AsyncClient:
        """This event loop's client."""
        return self._http.get()[0]

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        call = object()
        self._in_flight.add(id(call))
        client, pooled = self._http.get()
        try:
            body = sglang_api.generate_body(prompt_ids, params, self.adapter)
            if not isinstance(pooled, PooledTransport):  # a transport given from outside (tests' mocks)
                response = await client.post("/generate", json=body)
                status, text = response.status_code, response.content
            else:  # straight on the pool: the call a fleet makes thousands of times a second
                status, _, text = await pooled.send("POST", self.base_url + "/generate", self._json_headers,
                                                    orjson.dumps(body), self.timeout_s, self.timeout_s)
        finally:
            self._in_flight.discard(id(call))
            preempted = id(call) in self._preempted
            self._preempted.discard(id(call))
        if status != 200:
            raise ServerError(f"{self.base_url}/generate", status, text.decode(errors="replace"))
        out = sglang_api.output_from_sglang(_loads(text), params.routed_experts_from)
        out.prompt_tokens = out.prompt_tokens or len(prompt_ids)
        if preempted and out.finish_reason == "abort":
            out.message = PREEMPTED  # ended by abort_requests: to be continued, not a failure
        return out

    def mark_preempted(self) -> None:
        """The generate calls in flight now are ended by an abort that is ours (abort_requests)."""
        self._preempted |= self._in_flight

    async def abort_requests(self) -> None:
        self.mark_preempted()
        await self.post("/abort_request", sglang_api.abort_all_body())

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        with tempfile.TemporaryDirectory(dir=self.weight_dir, prefix="megarl-weights-") as tmp:
            disk.write_buckets(buckets, tmp, "bucket")
            await self.load_from_disk(tmp, version)

    async def load_from_disk(self, directory: str, version: int) -> None:
        """Make the server load every safetensors file in `directory` (on storage it can read)."""
        await self.post(disk.ROUTE, disk.update_body(directory, version))

    async def load_adapter(self, directory: str, version: int) -> None:
        """Load PEFT's adapter directory `directory` (on storage the server reads), report `version`
        as the server's weight version, and serve every later request with it; the adapter served
        before is unloaded once it is in (a server that no longer has it, restarted meanwhile, is fine)."""
        name, previous = adapters.adapter_name(version), self.adapter
        try:
            await self.post(adapters.LOAD_ROUTE, adapters.load_body(name, directory))
        except RuntimeError as e:  # loaded before: a reload (after a failed probe) loads it afresh
            if "already loaded" not in str(e):
                raise
            await self.post(adapters.UNLOAD_ROUTE, adapters.unload_body(name))
            await self.post(adapters.LOAD_ROUTE, adapters.load_body(name, directory))
        await self.post(adapters.VERSION_ROUTE, adapters.version_body(version))
        self.adapter = name
        if previous is not None and previous != name:
            try:
                await self.post(adapters.UNLOAD_ROUTE, adapters.unload_body(previous))
            except RuntimeError as e:
                log.warning("unloading the LoRA adapter %s from %s: %s", previous, self.base_url, e)

    async def post(self, route: str, body: dict, timeout_s: float | None = None) -> dict:
        """POST a control body; raise naming the server and its message unless it succeeded."""
        try:
            response = await self._client.post(route, json=body, timeout=timeout_s or self.timeout_s)
        except httpx.HTTPError as e:
            raise RuntimeError(f"{self.base_url}{route} failed: {type(e).__name__}: {e}") from e
        try:
            answer = response.json()
        except ValueError:
            answer = {"message": response.text[:500]}
        if not isinstance(answer, dict):  # SGLang's memory routes answer null
            answer = {"message": answer}
        if response.status_code != 200 or answer.get("success") is False:
            raise RuntimeError(f"{self.base_url}{route} answered {response.status_code}: "
                               f"{answer.get('message', answer)}")
        return answer

    async def begin_weight_update(self) -> None:
        """Pause, then open SGLang's weight-update session (the process-group and tensor routes
        load nothing outside one)."""
        await self.pause()
        await self.open_update_session()

    async def end_weight_update(self) -> None:
        """Close the session, drop the stale prefix cache, resume."""
        await self.close_update_session()
        await self.flush_cache()
        await self.resume()

    async def open_update_session(self) -> None:
        """/begin_weight_update; a session left open (by a sync that died before closing it)
        is closed first."""
        try:
            await self.post("/begin_weight_update", sglang_api.begin_update_body())
        except RuntimeError as e:
            if sglang_api.SESSION_OPEN not in str(e):
                raise
            await self.post("/end_weight_update", sglang_api.end_update_body())
            await self.post("/begin_weight_update", sglang_api.begin_update_body())

    async def close_update_session(self, missing_ok: bool = False) -> None:
        """/end_weight_update; with `missing_ok`, a server that has no session (it restarted
        during the sync) is fine."""
        try:
            await self.post("/end_weight_update", sglang_api.end_update_body())
        except RuntimeError as e:
            if not (missing_ok and sglang_api.NO_SESSION in str(e)):
                raise

    async def pause(self) -> None:
        await self.post("/pause_generation", sglang_api.pause_body())

    async def resume(self) -> None:
        await self.post("/continue_generation", sglang_api.continue_body())

    async def flush_cache(self) -> None:
        response = await self._client.post("/flush_cache")
        if response.status_code != 200:  # SGLang answers plain text
            raise RuntimeError(f"{self.base_url}/flush_cache answered {response.status_code}: {response.text[:300]}")

    async def release_memory(self, tags: list[str] | None = None) -> None:
        await self.post("/release_memory_occupation", sglang_api.memory_body(tags))

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self.post("/resume_memory_occupation", sglang_api.memory_body(tags))

    async def weight_checksums(self) -> dict[str, str]:
        response = await self._client.get("/weight_checksums")
        if response.status_code == 404:
            raise RuntimeError(f"{self.base_url} has no /weight_checksums route (megarl's embedded server has it, "
                               "SGLang does not): set sync.verify=false for this engine")
        response.raise_for_status()
        return response.json()

    async def prompt_log_probs(self, token_ids: list[int], timeout_s: float = PROBE_TIMEOUT_S) -> list[float]:
        """The server's log-prob of each token after the first given the ones before it, from the
        raw logits (the weights probe: megarl.weights.probe), within `timeout_s`."""
        response = await self._client.post("/generate", json=sglang_api.prompt_log_probs_body(token_ids, self.adapter),
                                           timeout=min(self.timeout_s, timeout_s))
        if response.status_code != 200:
            raise ServerError(f"{self.base_url}/generate", response.status_code, response.text)
        return sglang_api.prompt_log_probs_from_sglang(_loads(response.content), len(token_ids))

    async def probe_log_probs(self, sequences: list[list[int]]) -> dict[str, list[list[float]]]:
        return {self.base_url: list(await asyncio.gather(*[self.prompt_log_probs(s) for s in sequences]))}

    async def health(self, timeout_s: float = 30.0) -> bool:
        try:
            response = await self._client.get("/health_generate", timeout=min(self.timeout_s, timeout_s))
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def close(self) -> None:
        """Close the client of every event loop that used this engine."""
        await self._http.aclose()
