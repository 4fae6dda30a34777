"""The ipc transport's collectives with several train ranks (megarl.weights.ipc): each bucket
goes from its stage's source to every rank, every rank on an engine's GPU makes a handle of its
own copy, each engine's lead rank posts the handles in its TP ranks' order, and a failure one
rank sees is raised on every rank.

This process is rank 0 of a gloo group and the other ranks are processes forked from it, so every
rank runs the code this process imported (mutation testing's changed code included: a test that
spawned its ranks would import megarl afresh). The handles here are the bucket's tensors written
out as the rank that made the handle sees them; what the engines were posted is read back from
a route on a thread of this process."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from fastapi import FastAPI, Request

from megarl.http_server import BackgroundServer
from megarl.weights.ipc import IpcSender
from megarl.weights.transport import RankPlace

DEADLINE_S = 20  # each collective's and each post's; a rank that misses one fails instead of hanging the test


def tensors_in(flat) -> dict:
    """The bucket as the engine reads it: each entry's bytes viewed as its dtype and shape."""
    out = {}
    for e in flat.entries:
        raw = flat.data[e.offset: e.offset + e.nbytes]
        out[e.name] = [e.dtype, list(e.shape), raw.view(getattr(torch, e.dtype)).reshape(e.shape).float().tolist()]
    return out


class ContentHandles:
    """A handle that says which rank made it, on what device, and what the bucket holds there."""

    def __init__(self, rank: int):
        self.rank = rank

    def serialize(self, flat) -> str:
        return json.dumps({"by": self.rank, "device": flat.data.device.type, "tensors": tensors_in(flat)})


class Buckets:
    """A rank's export: a list of buckets that counts how often it is iterated and how far."""

    def __init__(self, buckets):
        self.buckets, self.iterations, self.taken = buckets, 0, 0

    def __iter__(self):
        self.iterations += 1
        return self._take()

    def _take(self):
        for bucket in self.buckets:
            self.taken += 1
            yield bucket


def as_sent(tensor: torch.Tensor) -> list:
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), tensor.float().tolist()]


def run_rank(rank: int, case: dict, url: str) -> dict:
    leads = [(url + "/" + engine, tp_ranks) for engine, tp_ranks in case["leads"].get(rank, [])]
    sender = IpcSender(case["places"], rank, leads, rank in case["makers"],
                       handles=ContentHandles(rank) if rank in case["makers"] else None, timeout_s=DEADLINE_S)
    sender.open()
    export = Buckets(case["buckets"][rank])
    try:
        count = sender.send(export, 7)
    except RuntimeError as e:
        return {"error": str(e), "iterations": export.iterations, "taken": export.taken}
    return {"count": count, "iterations": export.iterations, "taken": export.taken}


def rank_process(rank: int, world: int, store: str, case: dict, url: str, conn) -> None:
    try:
        torch.set_num_threads(1)  # a forked child must not start the parent's OpenMP pool
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=DEADLINE_S))
        conn.send(run_rank(rank, case, url))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to rank 0
        conn.send({"crashed": f"{type(e).__name__}: {e}"})
    finally:
        os._exit(0)


def run_ranks(case: dict, tmp_path, refusing: frozenset = frozenset()) -> tuple[list[dict], list]:
    """Every rank's result (rank 0 here, the others forked) and the posts the engines got, in order."""
    if dist.is_initialized():
        pytest.fail("this process already holds a torch.distributed group; the test needs its own")
    world = len(case["places"])
    posts = []
    app = FastAPI()

    @app.post("/{engine}/update_weights_from_tensor")
    async def update(engine: str, request: Request):
        posts.append((engine, await request.json()))
        if engine in refusing:
            return {"success": False, "message": f"{engine} refuses"}
        return {"success": True, "message": ""}

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    store = str(tmp_path / "store")
    fork = multiprocessing.get_context("fork")
    children = []
    for rank in range(1, world):  # forked before the server's thread starts
        receive, send = fork.Pipe(duplex=False)
        process = fork.Process(target=rank_process, args=(rank, world, store, case, url, send), daemon=True)
        process.start()
        children.append((process, receive))
    results = []
    try:
        with BackgroundServer(app, sock=sock):
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=world,
                                    timeout=timedelta(seconds=DEADLINE_S))
            try:
                results.append(run_rank(0, case, url))
            finally:
                dist.destroy_process_group()
            for process, receive in children:
                assert receive.poll(3 * DEADLINE_S), "a rank gave no result"
                results.append(receive.recv())
    finally:
        for process, _ in children:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return results, posts


F32_A = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4
BF16_B = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
F32_C = torch.full((2, 2), 7.0)
I64_D = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int64)
F32_E = torch.tensor([0.5, 0.25])

# two ranks, one a stage (PP 2): engine "a" has TP 2, one TP rank on each rank's GPU, led by rank 0;
# engine "b" has TP 1 on rank 1's GPU. Stage 0's first bucket mixes two dtypes: two flat buckets.
TWO_STAGES = {
    "places": [RankPlace(0, "127.0.0.1", "0", 0, True), RankPlace(1, "127.0.0.1", "1", 1, True)],
    "leads": {0: [("a", [0, 1])], 1: [("b", [1])]},
    "makers": {0, 1},
    "buckets": {0: [{"a": F32_A, "b": BF16_B}, {"c": F32_C}], 1: [{"d": I64_D}]},
}
SENT_IN_ORDER = [{"a": as_sent(F32_A)}, {"b": as_sent(BF16_B)}, {"c": as_sent(F32_C)}, {"d": as_sent(I64_D)}]


def handles_of(posts, engine):
    return [[json.loads(h) for h in body["serialized_named_tensors"]] for e, body in posts if e == engine]


def test_each_engine_tp_rank_gets_a_handle_from_its_own_gpus_rank_holding_every_stages_buckets(tmp_path):
    results, posts = run_ranks(TWO_STAGES, tmp_path)
    # every rank hands over every flat bucket of both stages, and iterates its own export once, whole
    assert results == [{"count": 4, "iterations": 1, "taken": 2}, {"count": 4, "iterations": 1, "taken": 1}]
    assert all(body["weight_version"] == "7" and body["load_format"] == "flattened_bucket" and
               body["flush_cache"] is False for _, body in posts)
    a = handles_of(posts, "a")
    assert [[h["by"] for h in post] for post in a] == [[0, 1]] * 4  # TP rank i's handle made on its GPU's rank
    assert [post[0]["tensors"] for post in a] == SENT_IN_ORDER
    assert [post[1]["tensors"] for post in a] == SENT_IN_ORDER  # the other stage's source's bytes, on each rank
    assert all(h["device"] == "cpu" for post in a for h in post)
    b = handles_of(posts, "b")
    assert [[h["by"] for h in post] for post in b] == [[1]] * 4
    assert [post[0]["tensors"] for post in b] == SENT_IN_ORDER


def test_a_refusal_one_rank_sees_stops_every_rank_after_that_bucket(tmp_path):
    results, posts = run_ranks(TWO_STAGES, tmp_path, refusing=frozenset({"b"}))
    assert sorted(e for e, _ in posts) == ["a", "b"]  # the first bucket, then nothing more
    error = results[0]["error"]
    assert error.startswith("http://127.0.0.1:") and error.endswith(
        '/b failed to load a weight bucket through CUDA IPC: 200 {"success":false,"message":"b refuses"}')
    # rank 1's stage comes second: its export was never started
    assert results == [{"error": error, "iterations": 1, "taken": 1}, {"error": error, "iterations": 0, "taken": 0}]


# three ranks: stage 0 at TP 2 (rank 0 its source, rank 1 another TP rank, no engine on its GPU),
# stage 1 on rank 2; engine "a" (TP 2) on ranks 0 and 2, led by rank 0
THREE_RANKS = {
    "places": [RankPlace(0, "127.0.0.1", "0", 0, True), RankPlace(1, "127.0.0.1", "1", 0, False),
               RankPlace(2, "127.0.0.1", "2", 1, True)],
    "leads": {0: [("a", [0, 2])]},
    "makers": {0, 2},
    "buckets": {0: [{"a": F32_A}, {"c": F32_C}], 1: [{"a": -F32_A}, {"c": -F32_C}], 2: [{"e": F32_E}]},
}


def test_a_stages_other_ranks_advance_their_export_in_step_and_only_engine_gpus_make_handles(tmp_path):
    results, posts = run_ranks(THREE_RANKS, tmp_path)
    # rank 1 takes each of its buckets as its source sends one (its export's gathers are collectives)
    assert results == [{"count": 3, "iterations": 1, "taken": 2}, {"count": 3, "iterations": 1, "taken": 2},
                       {"count": 3, "iterations": 1, "taken": 1}]
    a = handles_of(posts, "a")
    assert [[h["by"] for h in post] for post in a] == [[0, 2]] * 3
    expected = [{"a": as_sent(F32_A)}, {"c": as_sent(F32_C)}, {"e": as_sent(F32_E)}]
    assert [post[0]["tensors"] for post in a] == expected and [post[1]["tensors"] for post in a] == expected
