"""SGLang's native HTTP API, both ways: serve any engine with it, and use any server that
speaks it as a `RolloutEngine`.

`create_engine_app(engine)` exposes an engine (the embedded one in CI) with SGLang's
payloads: `POST /generate` {input_ids, sampling_params, return_logprob} -> {text,
output_ids, meta_info: {finish_reason: {type, matched|length|message}, prompt_tokens,
completion_tokens, weight_version, output_token_logprobs: [[logprob, id, null], ...]}},
`/health`, `/health_generate`, `/flush_cache`, `/update_weights_from_disk`,
`/pause_generation`, `/continue_generation`, `/release_memory_occupation`,
`/resume_memory_occupation`. `HTTPEngine(url)` is the client the SGLang fleet uses, so the
same client code is exercised against the embedded server in CI.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterable
from pathlib import Path

import httpx
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from safetensors.torch import load_file, save_file

from megarl.rollout.engine import GenerationOutput, RolloutEngine, SamplingParams, WeightBucket


def output_to_sglang(out: GenerationOutput, return_logprob: bool, text: str = "") -> dict:
    if out.finish_reason == "stop":
        finish = {"type": "stop", "matched": out.matched_stop}
    elif out.finish_reason == "length":
        finish = {"type": "length", "length": len(out.token_ids)}
    else:
        finish = {"type": "abort", "message": out.message or "aborted"}
    meta = {"finish_reason": finish, "prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.token_ids),
            "weight_version": str(out.weight_version)}
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(out.log_probs, out.token_ids)]
    return {"text": text, "output_ids": list(out.token_ids), "meta_info": meta}


def output_from_sglang(payload: dict) -> GenerationOutput:
    meta = payload.get("meta_info") or {}
    finish = meta.get("finish_reason") or {"type": "abort", "message": "no finish_reason in the response"}
    logprobs = meta.get("output_token_logprobs")
    ids = payload.get("output_ids")
    if ids is None and logprobs is not None:
        ids = [item[1] for item in logprobs]
    if ids is None:
        raise ValueError("the server's response has neither output_ids nor output_token_logprobs; "
                         "megarl needs token ids (send return_logprob=true)")
    version = meta.get("weight_version")
    return GenerationOutput(
        token_ids=list(ids),
        log_probs=[float(item[0]) for item in logprobs] if logprobs is not None else [],
        finish_reason=finish.get("type", "abort"),
        matched_stop=finish.get("matched"),
        weight_version=int(version) if str(version or "").isdigit() else 0,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        message=finish.get("message"),
    )


def create_engine_app(engine: RolloutEngine, tokenizer=None) -> FastAPI:
    app = FastAPI(title="megarl engine (SGLang-compatible API)")

    async def one(ids, params: dict | None, return_logprob: bool) -> dict:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise HTTPException(400, "input_ids must be a non-empty list of token ids (or a list of such lists)")
        try:
            sampling = SamplingParams.from_sglang(params)
        except (ValueError, TypeError) as e:
            raise HTTPException(400, f"bad sampling_params: {e}")
        out = await engine.generate(ids, sampling)
        text = tokenizer.decode(out.token_ids) if tokenizer is not None else ""
        return output_to_sglang(out, return_logprob, text)

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

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        await engine.flush_cache()
        return {"success": True}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: dict):
        path = Path(str(body.get("model_path", "")))
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            return JSONResponse({"success": False, "message": f"no *.safetensors files in {path}"}, status_code=400)
        version = int(body.get("weight_version") or 0)
        try:
            await engine.update_weights((load_file(f) for f in files), version)
        except (KeyError, ValueError) as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        return {"success": True, "message": f"loaded {len(files)} files", "num_paused_requests": 0}

    @app.get("/weight_checksums")  # megarl's own route (sync.verify); SGLang has none
    async def checksums():
        return await engine.weight_checksums()

    for route, method in (("/pause_generation", "pause"), ("/continue_generation", "resume"),
                          ("/release_memory_occupation", "release_memory"),
                          ("/resume_memory_occupation", "resume_memory")):
        app.add_api_route(route, _caller(engine, method), methods=["GET", "POST"])
    return app


def _caller(engine, method: str):
    async def call():
        await getattr(engine, method)()
        return {"success": True}
    return call


class HTTPEngine:
    """A `RolloutEngine` backed by a server speaking SGLang's native API.

    Weights travel through `weight_dir` (shared storage): each bucket is written as a
    safetensors file there and the server is told to load the directory.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, weight_dir: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.weight_dir = weight_dir
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        body = {"input_ids": list(prompt_ids), "sampling_params": params.to_sglang(), "return_logprob": True}
        response = await self._client.post("/generate", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{self.base_url}/generate answered {response.status_code}: {response.text[:500]}")
        out = output_from_sglang(response.json())
        out.prompt_tokens = out.prompt_tokens or len(prompt_ids)
        return out

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        with tempfile.TemporaryDirectory(dir=self.weight_dir, prefix="megarl-weights-") as tmp:
            for i, bucket in enumerate(buckets):
                save_file({k: v.contiguous() for k, v in bucket.items()}, str(Path(tmp) / f"bucket-{i:05d}.safetensors"))
            response = await self._client.post("/update_weights_from_disk",
                                                json={"model_path": tmp, "weight_version": str(version)})
        if response.status_code != 200 or not response.json().get("success"):
            raise RuntimeError(f"{self.base_url} failed to load weights: {response.text[:500]}")

    async def _post(self, route: str) -> None:
        response = await self._client.post(route)
        response.raise_for_status()

    async def pause(self) -> None:
        await self._post("/pause_generation")

    async def resume(self) -> None:
        await self._post("/continue_generation")

    async def flush_cache(self) -> None:
        await self._post("/flush_cache")

    async def release_memory(self) -> None:
        await self._post("/release_memory_occupation")

    async def resume_memory(self) -> None:
        await self._post("/resume_memory_occupation")

    async def weight_checksums(self) -> dict[str, str]:
        response = await self._client.get("/weight_checksums")
        if response.status_code == 404:
            raise RuntimeError(f"{self.base_url} has no /weight_checksums route (megarl's embedded server has it, "
                               "SGLang does not): set sync.verify=false for this engine")
        response.raise_for_status()
        return response.json()

    async def health(self) -> bool:
        try:
            response = await self._client.get("/health_generate", timeout=min(self.timeout_s, 30.0))
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def close(self) -> None:
        await self._client.aclose()
