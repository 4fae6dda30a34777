"""Simulated SGLang engine servers for tools/bench/fleet_scale.py: many ports in one process,
each an H100 engine serving a 32B model with continuous batching, in simulated GPU time.

Each port answers what megarl's fleet client and sglang-router 0.3.2 call, with SGLang 0.5.23's
shapes (`/generate` with input_ids and sampling_params, meta_info with output_token_logprobs and
finish_reason; `/health`, `/health_generate`, `/get_model_info`, `/get_server_info`,
`/flush_cache`, `/abort_request`, pause and continue), over a small hand-written HTTP/1.1 server
(asyncio.Protocol, keep-alive, one request at a time per connection): 64 ports cost one event
loop. `/fleet_stats` is the bench's own route (what every engine served and its busy time).

The engine (`SimEngine`) runs SGLang's loop: all its running requests advance one decode step at
a time, a step lasting the planner's decode step (megarl.planner_time.decode_step_s: the weights
and the running requests' KV cache read once) for the batch and context it has, plus the prefill
of the requests that join at that step: their tokens the engine does not hold yet (a radix cache
keeps each trajectory's last turn), at 2 N FLOPs a token and the planner's forward efficiency
(E_FORWARD, of the GPU's BF16 peak). A request is admitted while the KV cache (planner_time
kv_tokens at the recipe's 0.85 memory fraction) holds its input and max_new_tokens beside the
running ones; the rest queue. Steps are timed against absolute deadlines, so a late wake-up of
this process is caught up and not counted as GPU time. Every GPU time is multiplied by
`time_scale`.

What the model "says" is scripted (`Script`): the request's sampling_seed names the trajectory
and turn (fleet_scale sends seed 8 x trajectory + turn), whose turn count (1-4) and turn lengths
(log-normal) `turn_lengths` draws from the run's seed; the response is that many filler tokens
then the turn's action (`<search> question </search>`, or `<answer> ... </answer>` on the last
turn), as tools/bench/agent.py's ScriptedPolicy does, with log-prob -0.5 each.

    python tools/bench/fleet_engines.py --script SCRIPT.json --engines 64 --ports-file F [--model-path DIR] --host H --port P

binds engines 1.. on free ports, writes every engine's port to F, then binds engine 0 on P.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import math
import os
import random
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megarl.http_auth import ENGINE_KEY_ENV  # noqa: E402
from megarl.planner_models import ModelShape  # noqa: E402
from megarl.planner_time import E_FORWARD, GPUS, active_params, decode_step_s, kv_tokens  # noqa: E402

SEED_STRIDE = 8  # sampling_seed = SEED_STRIDE x trajectory + turn
LOG_PROB = -0.5


@dataclass(frozen=True)
class LatencyModel:
    """Seconds of an engine's step, from the planner's figures (module docstring): a decode step
    is `decode_s + kv_s` x the tokens of context its batch holds (decode_step_s is linear in
    batch x context), a prefill `prefill_s` a token; all x time_scale."""

    decode_s: float
    kv_s: float
    prefill_s: float
    kv_capacity: int  # tokens of KV cache

    @classmethod
    def of(cls, model: str = "Qwen/Qwen2.5-32B", engine_tp: int = 2, gpu: str = "H100", gpu_bytes: float = 80e9,
           memory_fraction: float = 0.85, time_scale: float = 1.0) -> LatencyModel:
        shape, card = ModelShape.load(model), GPUS[gpu]
        weights = decode_step_s(shape, engine_tp, 1, 0, card)
        per_token = decode_step_s(shape, engine_tp, 1, 1, card) - weights
        prefill = 2 * active_params(shape) / (engine_tp * card.bf16_flops * E_FORWARD)
        return cls(weights * time_scale, per_token * time_scale, prefill * time_scale,
                   kv_tokens(shape, engine_tp, gpu_bytes, memory_fraction))

    def step_s(self, context_tokens: int, prefill_tokens: int) -> float:
        return self.decode_s + self.kv_s * context_tokens + self.prefill_s * prefill_tokens


def turn_lengths(seed: int, trajectory: int, median: float, sigma: float, longest: int) -> list[int]:
    """Tokens the model samples before each turn's action: 1 to 4 turns, each log-normal
    (`median`, `sigma` of its log), 8 to `longest` tokens; the same for the same arguments."""
    rng = random.Random(f"{seed}:{trajectory}")
    return [min(longest, max(8, round(median * math.exp(sigma * rng.gauss(0, 1)))))
            for _ in range(rng.randint(1, 4))]


@dataclass
class Script:
    """What the simulated model answers (module docstring); written by fleet_scale as JSON."""

    seed: int
    median: float
    sigma: float
    longest: int
    filler: list[int]  # token ids the sampled part is cut from
    searches: list[list[int]]  # per trajectory: its search action's ids
    answer: list[int]
    text: dict[int, str]  # token id -> its text (the response's "text", as SGLang returns it)

    @classmethod
    def load(cls, path: str) -> Script:
        raw = json.loads(Path(path).read_text())
        raw["text"] = {int(k): v for k, v in raw["text"].items()}
        return cls(**raw)

    def response(self, seed: int | None) -> tuple[list[int], str | None]:
        """(token ids, the stop string they end with) of the turn `seed` names."""
        if seed is None:  # a health check's one token
            return self.filler[:1], None
        trajectory, turn = divmod(seed, SEED_STRIDE)
        lengths = turn_lengths(self.seed, trajectory, self.median, self.sigma, self.longest)
        offset = trajectory % 97
        sampled = (self.filler * (2 + self.longest // len(self.filler)))[offset: offset + lengths[turn]]
        if turn == len(lengths) - 1:
            return sampled + self.answer, "</answer>"
        return sampled + self.searches[trajectory], "</search>"


@dataclass
class _Request:
    key: int | None  # the trajectory, whose last turn the radix cache keeps
    input_len: int
    new_tokens: int
    reserved: int  # KV tokens it takes: input + max_new_tokens
    done: asyncio.Future
    prefill: int = 0  # input tokens the cache did not hold when it arrived
    joined: int = 0  # the step it joined at


class SimEngine:
    """One engine's continuous batching in (simulated) GPU time: see the module docstring.
    `generate` returns the tokens of the input the cache held. `records`: [trajectory, turn,
    input tokens, new tokens, max_new_tokens, arrival, end] of every request, in arrival order
    (times of the event loop's clock: time.monotonic in a live process). `outstanding()`: the
    tokens it has yet to compute (what a least-loaded router weighs)."""

    def __init__(self, model: LatencyModel):
        self.model = model
        self.waiting: deque[_Request] = deque()
        self.finishing: list[tuple[int, int, _Request]] = []  # heap: (step it ends after, order, request)
        self.order = itertools.count()
        self.step = 0  # decode steps run so far
        self.context_base = 0  # sum of (input - joined step) over running: their context is this + batch x step
        self.reserved = 0
        self.cache: dict[int, int] = {}  # trajectory -> tokens of it the cache holds
        self.busy_s = 0.0  # GPU seconds with a step running
        self.records: list[tuple] = []
        self.queued_tokens = 0  # prefill + new tokens of the waiting requests
        self.finish_sum = 0  # sum of the running requests' finishing steps
        self.wake = asyncio.Event()

    async def generate(self, key: int | None, turn: int, input_len: int, new_tokens: int, max_new: int) -> int:
        loop = asyncio.get_running_loop()
        record = [key, turn, input_len, new_tokens, max_new, loop.time(), 0.0]
        self.records.append(record)
        cached = input_len - self.uncached(key, input_len)
        done = loop.create_future()
        self.waiting.append(_Request(key, input_len, new_tokens, input_len + max_new, done, input_len - cached))
        self.queued_tokens += input_len - cached + max(new_tokens, 1)
        self.wake.set()
        await done
        record[-1] = loop.time()
        return cached

    def uncached(self, key: int | None, input_len: int) -> int:
        """Input tokens a request would prefill here: those the radix cache does not hold."""
        return input_len - (min(self.cache.get(key, 0), input_len) if key is not None else 0)

    def outstanding(self) -> int:
        """Tokens still to compute: the waiting requests' prefill and new tokens, and the running
        ones' new tokens not yet decoded."""
        return self.queued_tokens + self.finish_sum - len(self.finishing) * self.step

    def _admit(self) -> int:
        """Admit what fits at this step boundary; the tokens to prefill."""
        prefill = 0
        while self.waiting and (not self.finishing or
                                self.reserved + self.waiting[0].reserved <= self.model.kv_capacity):
            r = self.waiting.popleft()
            r.joined = self.step
            self.reserved += r.reserved
            self.context_base += r.input_len - self.step
            prefill += r.prefill
            self.queued_tokens -= r.prefill + max(r.new_tokens, 1)
            self.finish_sum += self.step + max(r.new_tokens, 1)
            heapq.heappush(self.finishing, (self.step + max(r.new_tokens, 1), next(self.order), r))
        return prefill

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not self.finishing and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
                deadline = loop.time()
            prefill = self._admit()
            seconds = self.model.step_s(self.context_base + len(self.finishing) * self.step, prefill)
            self.busy_s += seconds
            deadline += seconds
            await asyncio.sleep(max(deadline - loop.time(), 0.0))
            self.step += 1
            while self.finishing and self.finishing[0][0] <= self.step:
                end, _, r = heapq.heappop(self.finishing)
                self.finish_sum -= end
                self.reserved -= r.reserved
                self.context_base -= r.input_len - r.joined
                if r.key is not None:
                    self.cache[r.key] = r.input_len + r.new_tokens
                if not r.done.done():
                    r.done.set_result(None)


class EngineServer:
    """One port's routes (see the module docstring) over a SimEngine."""

    def __init__(self, index: int, engine: SimEngine, script: Script, api_key: str, unknown: set, model_path: str):
        self.index, self.engine, self.script, self.unknown = index, engine, script, unknown
        self.info = orjson.dumps({"model_path": model_path, "tokenizer_path": model_path, "is_generation": True})
        self.auth = f"Bearer {api_key}" if api_key else ""
        self.rids = itertools.count()

    async def answer(self, method: str, path: str, headers: dict, body: bytes) -> tuple[int, bytes]:
        if self.auth and not path.startswith(("/health", "/metrics")) and headers.get("authorization") != self.auth:
            return 401, b'{"error": "Unauthorized"}'
        if path == "/generate" and method == "POST":
            return 200, orjson.dumps(await self.generate(orjson.loads(body)))
        if path in ("/health", "/health_generate"):
            return 200, b""
        if path in ("/get_model_info", "/model_info"):
            return 200, self.info
        if path in ("/get_server_info", "/server_info"):
            return 200, orjson.dumps({**orjson.loads(self.info), "tp_size": 2, "dp_size": 1,
                                      "max_total_num_tokens": self.engine.model.kv_capacity, "version": "0.5.23"})
        if path in ("/flush_cache", "/abort_request", "/pause_generation", "/continue_generation"):
            return 200, b'{"success": true, "status": "ok"}'
        if path == "/fleet_stats":
            return 200, orjson.dumps(self.stats())
        self.unknown.add(f"{method} {path}")
        return 404, b'{"error": "not served by the simulated engine"}'

    async def generate(self, body: dict) -> dict:
        ids, params = body["input_ids"], body.get("sampling_params") or {}
        seed = params.get("sampling_seed")
        out, stop = self.script.response(seed)
        max_new = int(params.get("max_new_tokens", 128))
        finish = {"type": "stop", "matched": stop}
        if len(out) > max_new or stop is None:
            out, finish = out[:max_new], {"type": "length", "length": min(len(out), max_new)}
        key, turn = divmod(seed, SEED_STRIDE) if seed is not None else (None, 0)
        cached = await self.engine.generate(key, turn, len(ids), len(out), max_new)
        meta = {"id": f"{self.index}-{next(self.rids)}", "finish_reason": finish, "prompt_tokens": len(ids),
                "completion_tokens": len(out), "cached_tokens": cached, "weight_version": "default"}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[LOG_PROB, t, None] for t in out]
        text = "".join(self.script.text.get(t, "") for t in out)
        return {"text": text, "output_ids": out, "meta_info": meta}

    def stats(self) -> dict:
        return {"engines": [{"busy_s": e.busy_s, "records": e.records} for e in ENGINES], "unknown": sorted(self.unknown)}


ENGINES: list[SimEngine] = []  # every engine of this process, for /fleet_stats
TASKS: list[asyncio.Task] = []  # their loops (a task nothing refers to may be collected)


class HTTPConnection(asyncio.Protocol):
    """HTTP/1.1 with Content-Length bodies, keep-alive; reading pauses while a request is
    answered, so answers go out in order."""

    def __init__(self, server: EngineServer):
        self.server, self.buffer, self.transport, self.task = server, bytearray(), None, None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._next()

    def _next(self) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        method, path = lines[0].split(" ")[:2]
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", 0))
        if len(self.buffer) < end + 4 + length:
            return
        body = bytes(self.buffer[end + 4: end + 4 + length])
        del self.buffer[: end + 4 + length]
        self.transport.pause_reading()
        self.task = asyncio.ensure_future(self._respond(method, path.split("?")[0], headers, body))

    async def _respond(self, method, path, headers, body) -> None:
        try:
            status, payload = await self.server.answer(method, path, headers, body)
        except Exception as e:  # a bad request: say so, as a server would
            status, payload = 400, orjson.dumps({"error": f"{type(e).__name__}: {e}"})
        if self.transport.is_closing():
            return
        reason = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found"}[status]
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, reason, len(payload), payload))
        if headers.get("connection", "").lower() == "close":
            self.transport.close()
            return
        self.transport.resume_reading()
        self._next()


async def serve(args) -> None:
    script = Script.load(args.script)
    model = LatencyModel.of(time_scale=args.time_scale)
    loop, unknown, key = asyncio.get_running_loop(), set(), os.environ.get(ENGINE_KEY_ENV, "")
    ENGINES.extend(SimEngine(model) for _ in range(args.engines))
    ports = [args.port] * args.engines
    for i in [*range(1, args.engines), 0]:  # engine 0 last: once it answers, the ports file is complete
        if i == 0:
            Path(args.ports_file).write_text(json.dumps(ports))
        server = EngineServer(i, ENGINES[i], script, key, unknown, args.model_path)
        listening = await loop.create_server(lambda s=server: HTTPConnection(s), args.host, ports[i] if i == 0 else 0,
                                             backlog=4096)
        ports[i] = listening.sockets[0].getsockname()[1]
        TASKS.append(asyncio.ensure_future(ENGINES[i].run()))
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", required=True)
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--ports-file", required=True)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--model-path", default="", help="what /get_model_info reports (the router loads its tokenizer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
