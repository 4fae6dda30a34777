"""SGLang's native HTTP API, both ways: serve any engine with it, and use any server that
speaks it as a `RolloutEngine`.

`create_engine_app(engine)` serves an engine (the embedded one: `python -m
megarl.rollout.serve`, the CPU fleet and CI) with the pinned SGLang version's routes and
payloads (`megarl.rollout.sglang_api`): `/generate`, `/health`, `/health_generate`,
`/flush_cache`, `/pause_generation` (retract), `/continue_generation`, weight updates from
disk and over a process group (`/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`), memory release and
resume, `/get_model_info`, `/get_server_info`, and megarl's own `/weight_checksums`.
`HTTPEngine(url)` is the client the SGLang fleet uses for each server; CI runs it against
the embedded server, and tests/test_sglang_contract.py checks its bodies against SGLang's.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterable
from pathlib import Path

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from safetensors.torch import load_file, save_file

from megarl.rollout import sglang_api
from megarl.rollout.engine import GenerationOutput, RolloutEngine, SamplingParams, WeightBucket


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = await request.json()
    except ValueError as e:
        raise HTTPException(400, f"the body is not JSON: {e}")
    if not isinstance(body, dict):
        raise HTTPException(400, "the body must be a JSON object")
    return body


def _result(success: bool, message: str) -> JSONResponse:
    return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)


def create_engine_app(engine: RolloutEngine, tokenizer=None, model_path: str = "") -> FastAPI:
    app = FastAPI(title="megarl engine (SGLang-compatible API)")
    groups: dict[str, object] = {}  # weight-update process groups by name

    async def one(ids, params: dict | None, return_logprob: bool) -> dict:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise HTTPException(400, "input_ids must be a non-empty list of token ids (or a list of such lists)")
        try:
            sampling = SamplingParams.from_sglang(params)
        except (ValueError, TypeError) as e:
            raise HTTPException(400, f"bad sampling_params: {e}")
        out = await engine.generate(ids, sampling)
        text = tokenizer.decode(out.token_ids) if tokenizer is not None else ""
        return sglang_api.output_to_sglang(out, return_logprob, text)

    @app.post("/generate")
    async def generate(body: dict):
        if "text" in body and "input_ids" not in body:
            raise HTTPException(400, "megarl engines take input_ids, not text (tokens in, tokens out)")
        ids, params = body.get("input_ids"), body.get("sampling_params")
        return_logprob = bool(body.get("return_logprob", False))
        if isinstance(ids, list) and ids and isinstance(ids[0], list):  # a batch
            per_item = params if isinstance(params, list) else [params] * len(ids)
            if len(per_item) != len(ids):
                raise HTTPException(400, f"{len(per_item)} sampling_params for {len(ids)} prompts")
            return await asyncio.gather(*[one(i, p, return_logprob) for i, p in zip(ids, per_item)])
        return await one(ids, params, return_logprob)

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

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await _json_body(request)
        path = Path(str(body.get("model_path", "")))
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            return JSONResponse({"success": False, "message": f"no *.safetensors files in {path}",
                                 "num_paused_requests": 0}, status_code=400)
        try:
            await engine.update_weights((load_file(f) for f in files), _version(body))
        except (KeyError, ValueError) as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, status_code=400)
        return {"success": True, "message": f"loaded {len(files)} files", "num_paused_requests": 0}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        from megarl import transport

        body = await _json_body(request)
        name = str(body.get("group_name", "weight_update_group"))
        backend = str(body.get("backend", "nccl"))
        if backend == "nccl" and not transport.torch.cuda.is_available():
            return _result(False, "backend nccl needs CUDA; this engine runs on the CPU: use gloo")
        try:  # the rendezvous blocks until every rank has joined: keep the event loop free
            groups[name] = await asyncio.to_thread(
                transport.open_update_group, backend, str(body["master_address"]), int(body["master_port"]),
                int(body["rank_offset"]), int(body["world_size"]), name)
        except KeyError as e:
            return _result(False, f"missing field {e}")
        except (RuntimeError, ValueError, OSError) as e:
            return _result(False, f"could not join update group {name}: {e}")
        return _result(True, f"joined update group {name}")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        from megarl import transport

        name = str((await _json_body(request)).get("group_name", "weight_update_group"))
        if name not in groups:
            return _result(False, f"no update group {name}")
        transport.close_update_group(groups.pop(name))
        return _result(True, f"destroyed update group {name}")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        from megarl import transport

        body = await _json_body(request)
        name = str(body.get("group_name", "weight_update_group"))
        if name not in groups:
            return _result(False, f"no update group {name}: call /init_weights_update_group first")
        if body.get("load_format") != sglang_api.FLATTENED_BUCKET:
            return _result(False, f"megarl's engine receives load_format={sglang_api.FLATTENED_BUCKET} only")
        try:
            tensors = await asyncio.to_thread(transport.receive_bucket, groups[name], body["names"], body["dtypes"],
                                              body["shapes"])
            await engine.update_weights([tensors], _version(body))
        except KeyError as e:
            return _result(False, f"missing field or unknown tensor {e}")
        except (RuntimeError, ValueError) as e:
            return _result(False, str(e))
        return _result(True, f"loaded {len(tensors)} tensors")

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor():
        return _result(False, "update_weights_from_tensor passes CUDA IPC handles, which megarl's embedded engine "
                              "does not take: use sync.transport=nccl or disk")

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        mode = (await _json_body(request)).get("mode", "abort")
        if mode not in ("retract", "in_place"):
            return JSONResponse({"message": f"mode {mode!r}: megarl's engine pauses without aborting requests "
                                 "(use retract or in_place)", "status": "error"}, status_code=400)
        await engine.pause()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await _json_body(request)
        await engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.get("/weight_checksums")  # megarl's own route (sync.verify); SGLang has none
    async def checksums():
        return await engine.weight_checksums()

    for route, method in (("/release_memory_occupation", "release_memory"),
                          ("/resume_memory_occupation", "resume_memory")):
        app.add_api_route(route, _caller(engine, method), methods=["GET", "POST"])
    return app


def _version(body: dict) -> int:
    version = body.get("weight_version")
    if version is not None and not str(version).isdigit():
        raise HTTPException(400, f"weight_version {version!r}: megarl's versions are step numbers")
    return int(version or 0)


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


class HTTPEngine:
    """A `RolloutEngine` backed by a server speaking SGLang's native API.

    `update_weights` takes buckets in this process and sends them through `weight_dir`
    (storage the server can read): each bucket a safetensors file, then one
    `/update_weights_from_disk`. The fleet's other transports use `post`.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, weight_dir: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.weight_dir = weight_dir
        self._clients: dict[int, httpx.AsyncClient] = {}

    @property
    def _client(self) -> httpx.AsyncClient:
        """This event loop's client: the trainer runs each step's rollouts in a fresh loop
        (asyncio.run), and an httpx connection belongs to the loop that opened it."""
        loop = id(asyncio.get_running_loop())
        if loop not in self._clients:
            self._clients = {loop: httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s)}
        return self._clients[loop]

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        response = await self._client.post("/generate", json=sglang_api.generate_body(prompt_ids, params))
        if response.status_code != 200:
            raise ServerError(f"{self.base_url}/generate", response.status_code, response.text)
        out = sglang_api.output_from_sglang(response.json())
        out.prompt_tokens = out.prompt_tokens or len(prompt_ids)
        return out

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        with tempfile.TemporaryDirectory(dir=self.weight_dir, prefix="megarl-weights-") as tmp:
            for i, bucket in enumerate(buckets):
                save_file({k: v.contiguous() for k, v in bucket.items()}, str(Path(tmp) / f"bucket-{i:05d}.safetensors"))
            await self.load_from_disk(tmp, version)

    async def load_from_disk(self, directory: str, version: int) -> None:
        """Make the server load every safetensors file in `directory` (on storage it can read)."""
        await self.post("/update_weights_from_disk", sglang_api.disk_update_body(directory, version))

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

    async def health(self, timeout_s: float = 30.0) -> bool:
        try:
            response = await self._client.get("/health_generate", timeout=min(self.timeout_s, timeout_s))
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def close(self) -> None:
        await self._client.aclose()
        self._clients = {}
