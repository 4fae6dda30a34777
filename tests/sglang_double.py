"""A stand-in for an SGLang 0.5.23 server with simulated GPUs, for tests/test_gpu_contract.py.

It speaks the control API megarl uses with SGLang's semantics, not only its fields:
- simulated devices: the server sees the GPUs of its CUDA_VISIBLE_DEVICES on `--node`, as an
  SGLang server started by Ray does, TP rank i on the i-th; a CUDA IPC entry made on a device it cannot see, or on another TP
  rank's device, is refused (SGLang's rebuild of a handle fails the same way);
- memory by tag (kv_cache, weights, cuda_graph): release/resume with no tags means all of them
  (sglang/srt/constants.py); generation needs all three (a request, or a health check, while any
  is released kills the server, as the illegal memory access kills SGLang's), a weight update
  needs the weights; a
  release is refused unless the server is idle (requests paused count as retracted, not running),
  and releasing the weights loses them unless `--enable-weights-cpu-backup` (torch_memory_saver
  maps fresh pages on resume: here every loaded tensor turns to NaN);
- one update request at a time (SGLang's scheduler), so an ordering deadlock between two
  servers shows as a timeout; `--hold GROUP=SECONDS` makes this server start on requests of
  GROUP only that long after they arrive (to force the order that deadlocks);
- a distributed update is received into the buffer SGLang would build from names, dtypes and
  shapes (byte offsets checked against each dtype's size, as FlattenedTensorBucket.empty does),
  and, with `--collective-dir`, only once every engine of the group has entered the same
  broadcast: NCCL's broadcast passes data along the ranks, so none completes alone (gloo's
  root sends to each rank, which would hide an ordering deadlock);
- a weight-update session (`/begin_weight_update` ... `/end_weight_update`) around the
  process-group and tensor updates, refused outside one, and a resume of memory that was not
  released refused;
- generation as SGLang's scheduler runs it (`--token-s S`: each new token takes S seconds and
  a request makes max_new_tokens of them; without it, one token at once), each token answered
  with the weight version it was made with (meta_info.weight_versions spans): a paused server holds
  its requests, running and new, until `/continue_generation`; `/abort_request` (`abort_all` or
  a `rid`) ends them with finish_reason abort and the tokens they have; `/flush_cache` answers 400
  while a request runs and the server is not paused (SGLang's `is_fully_idle`);
- `/health_generate` generates a token: while paused it waits (SGLang parks it) and answers 503
  after 20 s (`--health-park-s`) if still paused;
- `/weight_checksums` (megarl's embedded server's route) over what it loaded, and `/calls`,
  the order of the control requests it served; `--exit-on-resume TAG=MARKER` makes it die at its
  first resume of TAG (a crash in the middle of a sync's end).

    CUDA_VISIBLE_DEVICES=0,1 python tests/sglang_double.py --port P --node NODE [--hold GROUP=SECONDS] [--collective-dir DIR] [--token-s S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl.weights.buckets import weight_checksums  # noqa: E402
from megarl.weights.group import open_update_group  # noqa: E402

TAGS = ("kv_cache", "weights", "cuda_graph")


def device_uuid(node: str, gpu: str) -> str:
    """The UUID a simulated GPU reports (one per node and physical id)."""
    return f"GPU-{node}-{gpu}"


def read_sim_handle(handle: str) -> tuple[str, dict[str, torch.Tensor]]:
    """(device UUID the handle was made on, the tensors it points to) of a simulated handle
    (tests/test_gpu_contract.py SimHandles)."""
    payload = json.loads(handle)
    data = torch.frombuffer(bytearray(Path(payload["path"]).read_bytes()), dtype=torch.uint8)
    tensors = {}
    for name, dtype, shape, offset, nbytes in payload["entries"]:
        tensors[name] = data[offset: offset + nbytes].view(getattr(torch, dtype)).view(shape).clone()
    return payload["device"], tensors


def receive_layout(names: list, dtypes: list, shapes: list) -> tuple[list[tuple], int]:
    """SGLang's receive buffer for a flattened bucket: (name, dtype, shape, offset, nbytes)
    each, and the total bytes; a tensor at an offset its dtype cannot view is an error."""
    entries, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        torch_dtype = getattr(torch, dtype)
        if offset % torch_dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        nbytes = torch.Size(shape).numel() * torch_dtype.itemsize
        entries.append((name, torch_dtype, shape, offset, nbytes))
        offset += nbytes
    return entries, offset


def enter_together(directory: str, group: str, seq: int, rank: int, engines: int, timeout_s: float = 120.0) -> None:
    """Wait until every engine rank of `group` has entered its broadcast number `seq`."""
    Path(directory, f"{group}.{seq}.{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(Path(directory).glob(f"{group}.{seq}.*"))) < engines:
        if time.monotonic() > deadline:
            raise TimeoutError(f"broadcast {seq} of {group}: not every engine entered it")
        time.sleep(0.05)


def create_app(node: str, gpus: list[str], hold: dict[str, float], collective_dir: str | None = None,
               token_s: float = 0.0, weights_cpu_backup: bool = False,
               exit_on_resume: tuple[str, str] | None = None, health_park_s: float = 20.0) -> FastAPI:
    app = FastAPI()
    devices = [device_uuid(node, g) for g in gpus]
    released: set[str] = set()
    weights: dict[str, torch.Tensor] = {}
    groups: dict[str, object] = {}
    members: dict[str, tuple[int, int]] = {}  # group -> (this server's rank in it, engine ranks in it)
    received: dict[str, int] = {}  # group -> broadcasts taken so far
    calls: list[dict] = []
    one_at_a_time = threading.Lock()  # the scheduler takes one update request at a time
    state = {"version": "0", "paused": False, "session": False}
    requests: dict[str, dict] = {}  # rid -> {"running": bool, "abort": bool}

    def answer(ok: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)

    def log(route: str, **extra) -> None:
        calls.append({"route": route, "time": time.time(), **extra})

    def crash_if_released(route: str) -> None:
        """SGLang 0.5.23 takes requests while its memory is released (its scheduler checks
        nothing): a decode replays CUDA graphs on the unmapped KV cache, the illegal memory access
        kills the scheduler, and the scheduler takes the server down with it. Here too."""
        if released:
            print(f"{route} with memory released {sorted(released)}: CUDA error: an illegal memory access was "
                  "encountered", file=sys.stderr, flush=True)
            os._exit(9)

    @app.get("/health")
    async def health():
        return {}

    @app.get("/health_generate")
    async def health_generate():
        log("/health_generate", paused=state["paused"])
        crash_if_released("/health_generate")  # SGLang's health check generates a token
        parked_until = time.monotonic() + health_park_s  # SGLang parks the probe's generation while paused
        while state["paused"] and time.monotonic() < parked_until:
            await asyncio.sleep(0.05)
        if state["paused"]:
            return JSONResponse({"message": "health check timed out while the server is paused"}, status_code=503)
        return {}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        crash_if_released("/generate")
        log("/generate")
        rid = body.get("rid") or uuid.uuid4().hex
        want = int(body.get("sampling_params", {}).get("max_new_tokens", 1)) if token_s else 1
        request_state = requests[rid] = {"running": False, "abort": False, "made": 0,
                                         "prompt": len(body["input_ids"])}
        made, versions = 0, []
        try:
            while made < want and not request_state["abort"]:
                # a paused server holds the request in its queue (retracted): not running
                request_state["running"] = not state["paused"]
                await asyncio.sleep(token_s or 0.005)
                if request_state["running"] and not state["paused"]:
                    made += 1
                    request_state["made"] = made
                    versions.append(state["version"])
        finally:
            del requests[rid]
        finish = {"type": "abort", "message": "Abort in running"} if made < want else {"type": "length",
                                                                                        "length": want}
        spans = []  # SGLang's per-token versions: [{version, start, end}], end exclusive
        for i, version in enumerate(versions):
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": version, "start": i, "end": i + 1})
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": made, "weight_version": state["version"], "weight_versions": spans,
                "output_token_logprobs": [[-0.5, 7, None]] * made}
        return {"text": "", "output_ids": [7] * made, "meta_info": meta}

    @app.get("/v1/loads")
    async def loads():  # SGLang's load report, the fields tests poll for progress
        running = [r for r in requests.values() if r["running"]]
        return {"loads": [{"num_running_reqs": len(running),
                           "num_used_tokens": sum(r["prompt"] + r["made"] for r in requests.values())}]}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await request.json()
        log("/abort_request", **body)
        for rid, request_state in requests.items():
            if body.get("abort_all") or body.get("rid") == rid:
                request_state["abort"] = True
        return None

    def memory_route(route: str, change) -> None:
        """release / resume_memory_occupation: the named tags (none named: all of them)."""
        async def handle(request: Request):
            tags = (await request.json()).get("tags") or list(TAGS)
            log(route, tags=tags)
            change(tags)
            return None
        app.post(route)(handle)

    def release(tags: list[str]) -> None:
        running = sum(r["running"] for r in requests.values())
        if running and not state["paused"]:  # SGLang's scheduler asserts it is idle before it releases
            raise HTTPException(400, f"release_memory_occupation needs an idle server: {running} requests running")
        if "weights" in tags and not weights_cpu_backup:  # no copy kept: the resumed pages hold anything
            for name, tensor in weights.items():
                weights[name] = torch.full_like(tensor, float("nan")) if tensor.is_floating_point() else tensor
        released.update(tags)

    def resume(tags: list[str]) -> None:
        if exit_on_resume and exit_on_resume[0] in tags and not Path(exit_on_resume[1]).exists():
            Path(exit_on_resume[1]).touch()  # once: a restarted server keeps the same arguments
            os._exit(9)  # dies in the middle of the resume, as a crashed scheduler takes its server down
        if not set(tags) <= released:  # SGLang's scheduler: offload_tags.remove(tag) of a tag it never released
            raise HTTPException(500, f"resume of memory that was not released: {sorted(set(tags) - released)}")
        released.difference_update(tags)

    memory_route("/release_memory_occupation", release)
    memory_route("/resume_memory_occupation", resume)

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        log("/begin_weight_update")
        if state["session"]:
            return answer(False, "a weight-update session is already open; call end_weight_update() first")
        state["session"] = True
        return answer(True, "Success")

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        log("/end_weight_update")
        if not state["session"]:
            return answer(False, "no weight-update session is open; call begin_weight_update() first")
        state["session"] = False
        return answer(True, "Success")

    def outside_session(route: str) -> JSONResponse | None:
        """SGLang refuses these updates outside a session, before it joins any broadcast."""
        if state["session"]:
            return None
        return answer(False, f"{route} must run between begin_weight_update() and end_weight_update()")

    @app.post("/pause_generation")
    async def pause(request: Request):
        log("/pause_generation", in_flight=len(requests))
        state["paused"] = True
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        log("/continue_generation", released=sorted(released))
        state["paused"] = False
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        log("/flush_cache")
        running = sum(r["running"] for r in requests.values())
        if running and not state["paused"]:  # SGLang flushes only when idle (waiting requests count unless paused)
            return Response("Flush cache failed.\n", status_code=400)
        return Response("Cache flushed.\n", status_code=200)

    def serialised(group: str, work):
        """Run `work` when this server's scheduler takes the request (after any hold)."""
        time.sleep(hold.get(group, 0.0))
        with one_at_a_time:
            return work()

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = await request.json()
        if (refused := outside_session("update_weights_from_tensor")) is not None:
            return refused
        if "weights" in released:
            return answer(False, "the weights' memory is released: resume it before updating")
        handles = body["serialized_named_tensors"]
        if len(handles) != len(devices):
            return answer(False, f"{len(handles)} serialized entries for {len(devices)} TP ranks")
        loaded = []
        for tp_rank, handle in enumerate(handles):
            made_on, tensors = read_sim_handle(handle)
            if made_on not in devices:
                return answer(False, f"TP rank {tp_rank}: handle made on {made_on}, a device this server "
                                     f"cannot see (visible: {devices})")
            if made_on != devices[tp_rank]:
                return answer(False, f"TP rank {tp_rank} runs on {devices[tp_rank]} but its handle was made on "
                                     f"{made_on} (TP rank {devices.index(made_on)}'s device)")
            loaded.append(tensors)
        if any(set(t) != set(loaded[0]) or any(not torch.equal(t[k], loaded[0][k]) for k in t) for t in loaded):
            return answer(False, "the TP ranks' handles point to different tensors")
        await asyncio.to_thread(serialised, "ipc", lambda: weights.update(loaded[0]))
        state["version"] = str(body.get("weight_version", state["version"]))
        log("/update_weights_from_tensor", names=sorted(loaded[0]))
        return answer(True, "Success")

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        body = await request.json()
        name = body["group_name"]
        if len(devices) != 1:
            return answer(False, "this stand-in joins update groups as one rank: start it with one GPU")
        groups[name] = await asyncio.to_thread(open_update_group, body["backend"], body["master_address"],
                                               body["master_port"], body["rank_offset"], body["world_size"],
                                               name, 60.0)
        members[name] = (int(body["rank_offset"]), int(body["world_size"]) - 1)
        received[name] = 0
        log("/init_weights_update_group", group=name)
        return answer(True, f"joined {name}")

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request):
        name = (await request.json())["group_name"]
        if name not in groups:
            return answer(False, f"no group {name}")
        torch.distributed.destroy_process_group(groups.pop(name))
        return answer(True, f"left {name}")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await request.json()
        name = body["group_name"]
        if (refused := outside_session("update_weights_from_distributed")) is not None:
            return refused
        if "weights" in released:
            return answer(False, "the weights' memory is released: resume it before updating")
        if name not in groups:
            return answer(False, f"Group {name} not in {list(groups)}")
        try:
            entries, total = receive_layout(body["names"], body["dtypes"], body["shapes"])
        except ValueError as e:
            return answer(False, str(e))

        def receive():
            log("/update_weights_from_distributed", group=name, names=list(body["names"]))
            received[name] += 1
            if collective_dir:
                enter_together(collective_dir, name, received[name], *members[name])
            buffer = torch.empty(total, dtype=torch.uint8)
            torch.distributed.broadcast(buffer, src=0, group=groups[name])
            for n, dtype, shape, offset, nbytes in entries:
                weights[n] = buffer[offset: offset + nbytes].view(dtype).view(shape).clone()

        await asyncio.to_thread(serialised, name, receive)
        state["version"] = str(body.get("weight_version", state["version"]))
        return answer(True, "Succeeded to update parameter online.")

    @app.get("/weight_checksums")
    async def checksums():
        return weight_checksums(sorted(weights.items()))

    @app.get("/calls")
    async def served():
        return calls

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="0: any free port, written to --port-file")
    parser.add_argument("--port-file", help="where the port this server listens on is written once it is bound")
    parser.add_argument("--node", default="node0")
    parser.add_argument("--hold", action="append", default=[])
    parser.add_argument("--collective-dir")
    parser.add_argument("--token-s", type=float, default=0.0, help="seconds per generated token (0: one token at once)")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true", help="keep the weights across a release")
    parser.add_argument("--health-park-s", type=float, default=20.0, help="a paused server's health check fails after")
    parser.add_argument("--exit-on-resume", metavar="TAG=MARKER", help="exit at the first resume of TAG (then MARKER "
                        "exists: a restarted server with these arguments goes on)")
    args = parser.parse_args()
    hold = {k: float(v) for k, v in (h.split("=") for h in args.hold)}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if not visible:
        parser.error("CUDA_VISIBLE_DEVICES names no GPU: set it to the simulated GPUs this server sees")
    app = create_app(args.node, visible.split(","), hold, args.collective_dir, args.token_s,
                     args.enable_weights_cpu_backup, tuple(args.exit_on_resume.split("=", 1)) if args.exit_on_resume
                     else None, args.health_park_s)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart takes its predecessor's port
    sock.bind((args.host, args.port))  # bound here, so the port a test is told is this server's
    if args.port_file:
        Path(args.port_file + ".part").write_text(str(sock.getsockname()[1]))
        os.replace(args.port_file + ".part", args.port_file)  # whole when the test reads it
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    main()
