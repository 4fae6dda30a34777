"""The nccl (process group) and disk transports with one side in this process: a source rank's
sender against megarl's engine server in another process, and the engine's routes here
against a sender in another process. What the engine holds afterwards is checked by its
checksums against the tensors sent; the groups' bookkeeping (joined, left, joined again after
an engine restart) by the engine's own answers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import pytest
import torch

from megarl.config import SGLangConfig, load_config
from megarl.driver_loop import run_async
from megarl.http_server import BackgroundServer
from megarl.rollout.http import HTTPEngine, create_engine_app
from megarl.rollout.local import LocalEngine
from megarl.rollout.sglang import SGLangFleet
from megarl.rollout.sglang_launch import ServerProcess, free_port
from megarl.weights.buckets import group_tensors, hf_tensors, weight_checksums
from megarl.weights.disk import DiskSender, DiskTransport, version_dir, weight_dir, write_buckets
from megarl.weights.group import GroupTransport
from megarl.weights.ipc import IpcSender
from megarl.weights.transport import RankPlace
from tiny_models import tiny_model, tiny_tokenizer

KEY = "transport-test-key"


class ThreadRanks:
    """One source rank in this process: its sender opens on a thread (the rendezvous blocks
    until the engines join, as on a Ray rank), `push` sends `tensors`."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors, self.senders, self.opened = tensors, {}, []

    def places(self):
        return [RankPlace(0, "127.0.0.1", "", 0, True)]

    def free_address(self, rank):
        return "127.0.0.1", free_port()

    def open_senders(self, senders):
        errors = []

        def run(sender):
            try:
                sender.open()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                errors.append(e)

        for rank, sender in senders.items():  # as a rank does: the old sender closed, the new one opened
            if rank in self.senders:
                self.senders[rank].close()
            self.senders[rank] = sender
        threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in senders.values()]
        for t in threads:
            t.start()
        self.opened.append(sorted(senders))

        def wait():
            for t in threads:
                t.join(timeout=30)
                assert not t.is_alive(), "a sender did not open within 30 s"
            if errors:
                raise errors[0]
        return wait

    def push(self, bucket_bytes, version, stage=None):
        return sum(s.send(group_tensors(self.tensors.items(), bucket_bytes), version) for s in self.senders.values())

    def close(self):
        for s in self.senders.values():
            s.close()


def model_dir(tmp_path):
    tok = tiny_tokenizer()
    tiny_model("qwen2", vocab_size=len(tok)).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


@pytest.fixture
def engine_process(tmp_path):
    server = ServerProcess([sys.executable, "-m", "megarl.rollout.serve", "--model-path", str(model_dir(tmp_path))],
                           "engine0", log_dir=str(tmp_path / "logs"), api_key=KEY)
    server.start(timeout_s=120)
    yield server
    server.stop()


def other_weights(seed=7):
    return dict(hf_tensors(tiny_model("qwen2", vocab_size=len(tiny_tokenizer()), seed=seed)))


def test_a_source_rank_here_loads_an_engine_server_and_rejoins_after_its_restart(engine_process):
    cfg = load_config(None, ["model.path=m", "rollout.engine=sglang", "rollout.sglang.server=embedded",
                             "sync.transport=nccl", "cluster.gpus_per_node=0",
                             "rollout.sglang.startup_timeout_s=20"])
    fleet = SGLangFleet([("engine0", None, engine_process.url, 1)], SGLangConfig(), api_key=KEY)
    client = HTTPEngine(engine_process.url, api_key=KEY)
    transport = GroupTransport(cfg, fleet)
    assert transport.backend == "gloo"
    sent = other_weights()
    ranks = ThreadRanks(sent)
    try:
        for version, restart in ((3, False), (4, True)):
            if restart:  # the fleet restarted it: the old group is left and a new one opened
                fleet.servers[0].restarts += 1
            transport.connect(ranks)
            transport.connect(ranks)  # nothing to do: no restart since
            run_async(client.open_update_session())
            buckets = ranks.push(bucket_bytes=20_000, version=version)
            run_async(client.close_update_session())
            assert buckets == len(list(group_tensors(sent.items(), 20_000)))  # one dtype: one bucket each
            assert run_async(client.weight_checksums()) == weight_checksums(sent.items())
            sent = other_weights(seed=8)
            ranks.tensors = sent
        assert ranks.opened == [[0], [0]] and transport.groups == ["megarl-sync-rank0"]
        # the engine left the first group when the second was opened: it has the second only
        with pytest.raises(RuntimeError, match="no update group megarl-sync-rank1"):
            run_async(client.post("/destroy_weights_update_group", {"group_name": "megarl-sync-rank1"}))
        transport.close()
        assert transport.groups == []
        with pytest.raises(RuntimeError, match="no update group megarl-sync-rank0"):  # left at close
            run_async(client.post("/destroy_weights_update_group", {"group_name": "megarl-sync-rank0"}))
    finally:
        ranks.close()
        for c in [client] + [s.client for s in fleet.servers]:
            run_async(c.close())


def test_a_bucket_the_engine_refuses_is_named_with_the_engines_answer(engine_process):
    cfg = load_config(None, ["model.path=m", "rollout.engine=sglang", "rollout.sglang.server=embedded",
                             "sync.transport=nccl", "cluster.gpus_per_node=0", "rollout.sglang.startup_timeout_s=20"])
    fleet = SGLangFleet([("engine0", None, engine_process.url, 1)], SGLangConfig(), api_key=KEY)
    client = HTTPEngine(engine_process.url, api_key=KEY)
    transport = GroupTransport(cfg, fleet)
    ranks = ThreadRanks({"model.not_a_layer.weight": torch.ones(3)})
    try:
        transport.connect(ranks)
        run_async(client.open_update_session())
        with pytest.raises(RuntimeError) as error:
            ranks.push(bucket_bytes=1 << 20, version=2)
        assert str(error.value).startswith(f"{engine_process.url} failed to load a weight bucket over the update "
                                           "group megarl-sync-rank0: 400 ")
        assert "model.not_a_layer.weight" in str(error.value)
        run_async(client.close_update_session())
    finally:
        transport.close()
        ranks.close()
        for c in [client] + [s.client for s in fleet.servers]:
            run_async(c.close())


SENDER = textwrap.dedent("""
    import sys, torch
    from megarl.weights.buckets import flatten
    from megarl.weights.group import broadcast_bucket, close_update_group, open_update_group
    port = int(sys.argv[1])
    group = open_update_group("gloo", "127.0.0.1", port, 0, 2, "megarl-sync-rank0", 60)
    print("joined", flush=True)
    broadcast_bucket(group, flatten({"lm_head.weight": torch.full((300, 64), 0.25)}, packed=True))
    sys.stdin.readline()  # the test has seen the engine's answer
    close_update_group(group)
""")


@contextmanager
def serve(app):
    """`app` served on a thread of this process (megarl.http_server.BackgroundServer); its URL."""
    with BackgroundServer(app) as server:
        yield server.url


@pytest.fixture
def served_here():
    tok = tiny_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tok))
    with serve(create_engine_app(LocalEngine(model, tok, eos_token_ids=[]), tok)) as url:
        yield url, model


def test_the_engine_routes_here_receive_a_bucket_from_a_sender_elsewhere(served_here):
    url, model = served_here
    assert model.lm_head.weight.shape == (300, 64)
    port = free_port()
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            joined = http.post("/init_weights_update_group", json={
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": "megarl-sync-rank0", "backend": "gloo"})
            assert joined.json() == {"success": True, "message": "joined update group megarl-sync-rank0"}
            assert sender.stdout.readline() == "joined\n"
            assert http.post("/begin_weight_update", json={}).status_code == 200
            body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[300, 64]],
                    "group_name": "megarl-sync-rank0", "weight_version": "9", "load_format": "flattened_bucket"}
            wrong = http.post("/update_weights_from_distributed", json={**body, "load_format": "direct"})
            assert wrong.status_code == 400 and wrong.json()["message"] == (
                "megarl's engine receives load_format=flattened_bucket only")
            loaded = http.post("/update_weights_from_distributed", json=body)
            assert loaded.json() == {"success": True, "message": "loaded 1 tensors"}
            assert http.post("/end_weight_update", json={}).status_code == 200
            assert torch.equal(model.lm_head.weight.detach(), torch.full((300, 64), 0.25))
            sender.stdin.write("\n")
            sender.stdin.flush()
            left = http.post("/destroy_weights_update_group", json={"group_name": "megarl-sync-rank0"})
            assert left.json() == {"success": True, "message": "destroyed update group megarl-sync-rank0"}
            again = http.post("/destroy_weights_update_group", json={"group_name": "megarl-sync-rank0"})
            assert again.status_code == 400 and again.json()["message"] == "no update group megarl-sync-rank0"
        assert sender.wait(timeout=60) == 0
    finally:
        sender.kill()


@pytest.mark.parametrize("body, message", [
    ({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": "g"},
     "backend nccl needs CUDA; this engine runs on the CPU: use gloo"),  # nccl is the default, as SGLang's
    ({"backend": "gloo", "master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": "g"},
     "missing field 'master_address'"),
    ({"backend": "gloo", "master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1, "world_size": 2,
      "group_name": "g"}, "could not join update group g: invalid literal for int() with base 10: 'x'"),
])
def test_a_group_the_engine_cannot_join_is_refused_by_name(served_here, body, message):
    url, _ = served_here
    answer = httpx.post(url + "/init_weights_update_group", json=body, timeout=30)
    assert answer.status_code == 400 and answer.json() == {"success": False, "message": message}


def test_an_ipc_sender_here_hands_each_bucket_to_its_engine_as_a_handle(tmp_path):
    import sglang_double
    from gpu_harness import SimHandles

    device = sglang_double.device_uuid("node0", "0")
    sent = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b.bias": torch.ones(5, dtype=torch.bfloat16),
            "c.weight": torch.full((4,), 2.0)}
    with serve(sglang_double.create_app("node0", ["0"], {})) as url:
        sender = IpcSender([RankPlace(0, "127.0.0.1", "0", 0, True)], 0, [(url, [0])], True,
                           handles=SimHandles(device, str(tmp_path)), timeout_s=30)
        sender.open()
        with httpx.Client(base_url=url, timeout=30) as http:
            refused = sender_error(sender, [sent], 1)  # no weight-update session open: SGLang refuses
            assert refused.startswith(f"{url} failed to load a weight bucket through CUDA IPC: 400 ")
            assert "must run between begin_weight_update() and end_weight_update()" in refused
            http.post("/begin_weight_update", json={})
            # two buckets; the first holds two dtypes, which go as two flat buckets
            assert sender.send([{k: sent[k] for k in ("a.weight", "b.bias")}, {"c.weight": sent["c.weight"]}], 2) == 3
            http.post("/end_weight_update", json={})
            assert http.get("/weight_checksums").json() == weight_checksums(sorted(sent.items()))
        elsewhere = IpcSender([RankPlace(0, "127.0.0.1", "1", 0, True)], 0, [(url, [0])], True,
                              handles=SimHandles(sglang_double.device_uuid("node0", "1"), str(tmp_path)))
        with httpx.Client(base_url=url, timeout=30) as http:
            http.post("/begin_weight_update", json={})
            assert "a device this server cannot see" in sender_error(elsewhere, [sent], 3)
    gone = IpcSender([RankPlace(0, "127.0.0.1", "0", 0, True)], 0, [(url, [0])], True,
                     handles=SimHandles(device, str(tmp_path)), timeout_s=5)
    assert sender_error(gone, [sent], 4).startswith(f"{url} did not answer a CUDA IPC weight update: ")


def sender_error(sender, buckets, version) -> str:
    with pytest.raises(RuntimeError) as error:
        sender.send(buckets, version)
    return str(error.value)


def test_the_disk_transport_writes_each_ranks_buckets_and_the_engines_load_the_version(tmp_path, served_here):
    url, model = served_here
    cfg = load_config(None, ["model.path=m", "rollout.engine=sglang", "rollout.sglang.server=embedded",
                             "sync.transport=disk", "cluster.gpus_per_node=0", f"trainer.output_dir={tmp_path / 'out'}"])
    assert weight_dir(cfg) == (tmp_path / "out" / "weight_sync").resolve() and weight_dir(cfg).is_dir()
    loads = []

    class Engines:  # the fleet's side of the disk transport: every engine loads the directory
        async def load_from_disk(self, directory, version):
            loads.append((directory, version))
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                answer = await http.post("/update_weights_from_disk",
                                         json={"model_path": directory, "weight_version": str(version)})
                assert answer.json()["success"], answer.text

    transport = DiskTransport(cfg, Engines())
    ranks = SimpleNamespace(places=lambda: [RankPlace(0, "n", "", 0, True), RankPlace(1, "n", "", 0, False),
                                            RankPlace(2, "n", "", 1, True)])
    senders = transport.senders(ranks)
    assert sorted(senders) == [0, 2] and all(isinstance(s, DiskSender) for s in senders.values())
    sent = other_weights()
    names = sorted(sent)
    halves = [{n: sent[n] for n in names[:3]}, {n: sent[n] for n in names[3:]}]
    assert senders[0].send([halves[0]], 5) == 1 and senders[2].send(iter([halves[1]]), 5) == 1
    directory = version_dir(transport.root, 5)
    assert directory == transport.root / "v000005"
    assert sorted(p.name for p in directory.iterdir()) == ["rank00000-00000.safetensors", "rank00002-00000.safetensors"]
    transport.finish(5)
    assert loads == [(str(directory), 5)]
    assert httpx.get(url + "/weight_checksums", timeout=30).json() == weight_checksums(sent.items())


def test_write_buckets_names_each_file_by_its_place_and_leaves_no_partial_file(tmp_path):
    from safetensors.torch import load_file

    buckets = [{"x": torch.ones(2)}, {"y": torch.zeros(3, dtype=torch.int64), "z": torch.eye(2)}]
    paths = write_buckets(buckets, tmp_path / "new" / "dir", "rank00003")
    assert [p.name for p in paths] == ["rank00003-00000.safetensors", "rank00003-00001.safetensors"]
    assert sorted(p.name for p in (tmp_path / "new" / "dir").iterdir()) == [p.name for p in paths]
    for path, bucket in zip(paths, buckets):
        loaded = load_file(path)
        assert loaded.keys() == bucket.keys() and all(torch.equal(loaded[k], bucket[k]) for k in bucket)


@pytest.mark.parametrize("body, status, message", [
    ({"model_path": "/nonexistent/megarl"}, 400, "no *.safetensors files in /nonexistent/megarl"),
    ({}, 400, "no *.safetensors files in ."),
    ({"model_path": "{dir}", "weight_version": "v2"}, 400, "weight_version 'v2': megarl's versions are step numbers"),
    ({"model_path": "{dir}"}, 400, "'model.no_such.weight'"),
])
def test_a_directory_the_engine_cannot_load_is_refused_by_name(tmp_path, served_here, body, status, message):
    url, _ = served_here
    write_buckets([{"model.no_such.weight": torch.ones(2)}], tmp_path, "rank00000")
    body = {k: v.replace("{dir}", str(tmp_path)) for k, v in body.items()}
    answer = httpx.post(url + "/update_weights_from_disk", json=body, timeout=30)
    assert answer.status_code == status and message in answer.json().get("message", answer.text)


def ipc_double_app(mode: str):
    """An engine's CUDA IPC route that answers as `mode` says (a test double of a failing engine)."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/update_weights_from_tensor")
    async def update():
        if mode == "slow":
            await asyncio.sleep(3)
        return {"success": mode != "refuses", "message": "x" * 600}

    return app


def one_rank_ipc(url, **kw):
    return IpcSender([RankPlace(0, "127.0.0.1", "0", 0, True)], 0, [(url, [0])], True,
                     handles=SimpleNamespace(serialize=lambda flat: "handle"), **kw)


def test_an_ipc_sender_reads_a_refusal_in_a_200_cuts_it_short_and_keeps_its_deadline():
    with serve(ipc_double_app("refuses")) as url:
        error = sender_error(one_rank_ipc(url), [{"a": torch.ones(2)}], 1)
    assert error == f"{url} failed to load a weight bucket through CUDA IPC: 200 " + (
        '{"success":false,"message":"' + "x" * 600 + '"}')[:500]
    with serve(ipc_double_app("slow")) as url:
        assert sender_error(one_rank_ipc(url, timeout_s=0.5), [{"a": torch.ones(2)}], 1).startswith(
            f"{url} did not answer a CUDA IPC weight update: ")


def test_an_ipc_sender_carries_the_engines_api_key():
    tok = tiny_tokenizer()
    engine = LocalEngine(tiny_model("qwen2", vocab_size=len(tok)), tok, eos_token_ids=[])
    with serve(create_engine_app(engine, tok, api_key=KEY)) as url:
        with_key = sender_error(one_rank_ipc(url, api_key=KEY), [{"a": torch.ones(2)}], 1)
        without = sender_error(one_rank_ipc(url), [{"a": torch.ones(2)}], 1)
    assert "passes CUDA IPC handles, which megarl's embedded engine does not take" in with_key  # past the key
    assert ": 401 " in without


def test_an_ipc_rank_sends_its_own_stage_and_makes_a_handle_only_where_an_engine_runs(tmp_path):
    import sglang_double
    from gpu_harness import SimHandles

    places = [RankPlace(0, "127.0.0.1", "0", 0, True), RankPlace(1, "127.0.0.1", "1", 1, True)]
    buckets = [{"a": torch.ones(2)}, {"b": torch.zeros(3)}]
    no_engine = IpcSender(places, 0, [], False)  # no engine on its GPU: no handle, nothing posted
    no_engine.open()
    assert no_engine.handles is None and no_engine.send(buckets, 1) == 2  # stage 1's source is another rank
    with serve(sglang_double.create_app("node0", ["0"], {})) as url:
        sender = IpcSender(places, 0, [(url, [0])], True, handles=SimHandles(sglang_double.device_uuid("node0", "0"),
                                                                             str(tmp_path)))
        with httpx.Client(base_url=url, timeout=30) as http:
            http.post("/begin_weight_update", json={})
            assert sender.send(buckets, 6) == 2
            http.post("/end_weight_update", json={})
            assert http.post("/generate", json={"input_ids": [1]}).json()["meta_info"]["weight_version"] == "6"


def test_an_ipc_sender_that_makes_handles_needs_sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` fails
    with pytest.raises(RuntimeError) as error:
        IpcSender([RankPlace(0, "127.0.0.1", "0", 0, True)], 0, [], True).open()
    assert str(error.value) == ("sync.transport=ipc serialises CUDA handles with SGLang's own code, so the train ranks "
                                "need SGLang 0.5.23 installed too (pip install -e '.[gpu]'), or use sync.transport=disk")
    module = SimpleNamespace()  # an SGLang that does not say its version
    monkeypatch.setitem(sys.modules, "sglang", module)
    with pytest.raises(RuntimeError, match="as of SGLang 0.5.23; this environment has unknown: install 0.5.23"):
        IpcSender([RankPlace(0, "127.0.0.1", "0", 0, True)], 0, [], True).open()


def test_sglang_handles_describe_each_tensor_as_sglangs_metadata_names_it(monkeypatch):
    from dataclasses import dataclass

    from megarl.weights import ipc
    from megarl.weights.buckets import flatten

    @dataclass
    class Metadata:  # FlattenedTensorMetadata's fields in SGLang 0.5.23 (tests/test_sglang_contract.py)
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    serialized = []

    class Serializer:
        @staticmethod
        def serialize(obj, output_str=False):
            serialized.append((obj, output_str))
            return "handle"

    monkeypatch.setattr(ipc, "sglang_ipc_api", lambda: (Serializer, Metadata))
    flat = flatten({"w": torch.ones(2, 3), "v": torch.zeros(4)}, packed=True)
    assert ipc.SGLangHandles().serialize(flat) == "handle"
    (obj, output_str), = serialized
    assert output_str is True and set(obj) == {"flattened_tensor", "metadata"} and obj["flattened_tensor"] is flat.data
    # offsets and numel in bytes: SGLang counts the bucket's uint8 view (weight_sync/tensor_bucket.py)
    assert obj["metadata"] == [Metadata("w", torch.Size([2, 3]), torch.float32, 0, 24, 24),
                               Metadata("v", torch.Size([4]), torch.float32, 24, 40, 16)]
