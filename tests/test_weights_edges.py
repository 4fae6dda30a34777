"""megarl.weights at its edges: the probe's tolerances and its reading of a model's config, its
errors word for word, the buckets' sizes at their boundaries, and the engine routes' helpers."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from fastapi import FastAPI, Request  # module level: FastAPI resolves the routes' annotations here

from megarl.weights.probe import Mismatch, WeightProbe, default_tolerance, is_mixture_of_experts


@pytest.mark.parametrize("dtype, on_gpu, moe, want", [
    ("float32", False, False, 1e-4), ("float32", True, False, 1e-3), ("float32", True, True, 1e-2),
    ("bfloat16", False, False, 0.05), ("bfloat16", True, True, 0.5), ("float16", True, False, 0.05),
])
def test_the_probes_tolerance_by_dtype_device_and_experts(dtype, on_gpu, moe, want):
    assert default_tolerance(dtype, on_gpu, moe) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("config, want", [
    ({"num_experts": 8}, True), ({"num_local_experts": 4}, True), ({"n_routed_experts": 64}, True),
    ({"text_config": {"num_experts": 2}, "num_experts": 0}, True),  # a multimodal config's text model
    ({"num_experts": 1}, False), ({"num_experts": None}, False), ({"hidden_size": 8}, False),
    ({"text_config": {"hidden_size": 8}, "num_experts": 8}, False),  # the text model's config is the one read
])
def test_a_mixture_of_experts_is_read_from_the_config(tmp_path, config, want):
    (tmp_path / "config.json").write_text(json.dumps(config))
    is_mixture_of_experts.cache_clear()
    assert is_mixture_of_experts(str(tmp_path)) is want


def test_a_config_that_cannot_be_read_is_not_a_mixture_of_experts(tmp_path):
    is_mixture_of_experts.cache_clear()
    assert is_mixture_of_experts(str(tmp_path / "missing")) is False
    (tmp_path / "config.json").write_text("{oops")
    assert is_mixture_of_experts(str(tmp_path)) is False


def test_a_mismatch_is_described_in_one_line():
    assert Mismatch("engine0", 0.12345, 2.5, 30).describe(1e-4) == (
        "engine0: mean |engine - trainer| log-prob 0.123 a token over 30 probe tokens (largest 2.5; tolerance 0.0001)")


def test_the_probe_refuses_what_it_cannot_compare():
    with pytest.raises(ValueError) as error:
        WeightProbe([], 0.1)
    assert str(error.value) == "the weights probe needs at least one sequence of two or more tokens"
    p = WeightProbe([[1, 2, 3], [4, 5]], 0.1)
    with pytest.raises(RuntimeError) as error:
        asyncio.run(p.mismatches(None))
    assert str(error.value) == "the weights probe has no trainer log-probs yet (WeightProbe.expect)"
    with pytest.raises(ValueError) as error:
        p.expect([torch.zeros(2), torch.zeros(2)], 3)  # the second sequence scores one token
    assert str(error.value) == "the trainer's probe log-probs do not cover every scored token of the probe"
    p.expect([torch.zeros(2, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float64)], 3)
    assert p.version == 3 and [t.dtype for t in p.expected] == [torch.float32, torch.float32]


def test_a_mismatch_exactly_at_the_tolerance_passes():
    p = WeightProbe([[1, 2]], 0.25)
    p.expect([torch.tensor([-1.0])], 1)

    class Engine:
        async def probe_log_probs(self, sequences):
            return {"at": [[-1.25]], "past": [[-1.2500001]]}

    assert [m.engine for m in asyncio.run(p.mismatches(Engine()))] == ["past"]



# -- buckets, bodies and the transports' config rules

def test_two_buckets_are_in_flight_by_default():
    from megarl.weights.buckets import send_flat

    events = []
    count = send_flat([{"a": torch.ones(1)}, {"b": torch.ones(1)}, {"c": torch.ones(1)}],
                      send=lambda flat: events.append(("send", flat.names[0])) or flat.names[0],
                      wait=lambda handle: events.append(("wait", handle)))
    assert count == 3
    assert events == [("send", "a"), ("send", "b"), ("wait", "a"), ("send", "c"), ("wait", "b"), ("wait", "c")]


def test_the_weight_update_bodies_word_for_word():
    from megarl.weights.disk import update_body
    from megarl.weights.ipc import tensor_update_body

    assert update_body("/w/v000005", 5) == {"model_path": "/w/v000005", "weight_version": "5", "flush_cache": False}
    assert tensor_update_body(["h0", "h1"], 7) == {"serialized_named_tensors": ["h0", "h1"],
                                                   "load_format": "flattened_bucket", "weight_version": "7",
                                                   "flush_cache": False}


def transport_problems(transport: str, engine: str) -> list[tuple[str, str, str]]:
    from megarl.config import load_config
    from megarl.config_loader import Problems
    from megarl.weights import transport_class

    cfg = load_config(None, ["model.path=m"])
    cfg.rollout.engine = engine
    problems = Problems()
    transport_class(transport).check(cfg, problems)
    return [(p.key, p.what, p.fix) for p in problems.items]


def test_each_transport_names_the_engine_it_needs():
    assert transport_problems("disk", "local") == [
        ("sync.transport", "disk is for engine servers; the embedded engine takes weights in process",
         "use sync.transport=auto or rollout.engine=sglang")]
    assert transport_problems("disk", "sglang") == []
    assert transport_problems("inprocess", "sglang") == [
        ("sync.transport", "inprocess needs the embedded engine (rollout.engine=local)",
         "use auto, ipc, nccl or disk with rollout.engine=sglang")]
    assert transport_problems("inprocess", "local") == []


def test_a_transport_without_senders_says_which():
    from megarl.weights.transport import WeightTransport

    class Bare(WeightTransport):
        name = "bare"

    with pytest.raises(NotImplementedError) as error:
        Bare(None, None).senders(None)
    assert str(error.value) == "Bare keeps the default connect: it must define senders"


def test_the_disk_transport_keeps_its_config(tmp_path):
    from megarl.config import load_config
    from megarl.weights.disk import DiskTransport

    cfg = load_config(None, ["model.path=m", "rollout.engine=sglang", f"sync.disk_dir={tmp_path}"])
    transport = DiskTransport(cfg, None)
    assert transport.cfg is cfg and transport.root == tmp_path.resolve()


def test_the_inprocess_sender_hands_each_bucket_with_its_version():
    from megarl.weights.inprocess import EngineSender

    class Engine:
        def __init__(self):
            self.calls = []

        async def update_weights(self, buckets, version):
            self.calls.append((buckets, version))

    engine = Engine()
    buckets = [{"a": torch.ones(1)}, {"b": torch.zeros(2)}, {"c": torch.ones(3)}]
    assert EngineSender(engine).send(iter(buckets), 7) == 3
    assert [(b[0], v) for b, v in engine.calls] == [(buckets[0], 7), (buckets[1], 7), (buckets[2], 7)]


# -- the process group's receiving side

def one_rank_group():
    from megarl.rollout.sglang_launch import free_port
    from megarl.weights.group import open_update_group

    return open_update_group("gloo", "127.0.0.1", free_port(), 0, 1, "megarl-test-one", 30)


@pytest.mark.parametrize("names, dtypes, shapes, message", [
    (["a", "b"], ["float32"], [[1], [1]], "names, dtypes and shapes must be non-empty and equally long (2, 1, 2)"),
    ([], [], [], "names, dtypes and shapes must be non-empty and equally long (0, 0, 0)"),
    (["a"], ["float99"], [[1]], "a: unknown dtype 'float99'"),
    (["a"], ["Size"], [[1]], "a: unknown dtype 'Size'"),  # a torch attribute that is not a dtype
    (["a"], ["float32"], [[2, -1]], "a: negative dimension in shape [2, -1]"),
    (["a", "b"], ["int8", "float32"], [[3], [1]], "b: byte offset 3 is not a multiple of float32's size"),
])
def test_a_bucket_the_engine_cannot_lay_out_is_refused_before_receiving(names, dtypes, shapes, message):
    from megarl.weights.group import receive_bucket

    with pytest.raises(ValueError) as error:
        receive_bucket(None, names, dtypes, shapes)
    assert str(error.value) == message


def test_a_bucket_is_laid_out_back_to_back_from_names_dtypes_and_shapes():
    from megarl.weights.group import close_update_group, receive_bucket

    group = one_rank_group()
    try:
        got = receive_bucket(group, ["a", "b", "c"], ["torch.float32", "bfloat16", "int64"], [[2, 3], [0, 4], [5]])
    finally:
        close_update_group(group)
    assert list(got) == ["a", "b", "c"]
    assert [(t.dtype, tuple(t.shape)) for t in got.values()] == [(torch.float32, (2, 3)), (torch.bfloat16, (0, 4)),
                                                                (torch.int64, (5,))]
    base = got["a"].untyped_storage().data_ptr()
    assert got["c"].untyped_storage().data_ptr() == base  # one buffer: a at 0, b empty, c at 24 bytes
    assert got["c"].data_ptr() - base == 24 and got["c"].untyped_storage().nbytes() == 24 + 40


def test_a_group_nobody_joins_fails_within_its_timeout():
    import time

    from megarl.rollout.sglang_launch import free_port
    from megarl.weights.group import open_update_group

    start = time.monotonic()
    with pytest.raises(Exception):  # torch's DistStoreError / RuntimeError: the peer never came
        open_update_group("gloo", "127.0.0.1", free_port(), 0, 2, "megarl-test-alone", timeout_s=2)
    assert time.monotonic() - start < 30


# -- the engine routes' helpers

def route_app():
    from megarl.weights.routes import json_body, session_refusal

    app = FastAPI()

    @app.post("/body")
    async def body(request: Request):
        return await json_body(request)

    @app.post("/update_weights_from_disk")
    async def update(request: Request):
        return session_refusal(request, "/update_weights_from_disk") or {"success": True}

    return app


def test_a_body_that_is_not_a_json_object_is_a_400_that_says_so():
    from fastapi.testclient import TestClient

    with TestClient(route_app()) as client:
        assert client.post("/body", content=b"").json() == {}
        assert client.post("/body", json={"a": 1}).json() == {"a": 1}
        wrong = client.post("/body", json=[1, 2])
        assert wrong.status_code == 400 and wrong.json() == {"detail": "the body must be a JSON object"}
        broken = client.post("/body", content=b"{oops", headers={"content-type": "application/json"})
        assert broken.status_code == 400 and broken.json()["detail"].startswith("the body is not JSON: ")


def test_a_weight_route_outside_a_session_is_refused_as_sglang_refuses_it():
    from fastapi.testclient import TestClient

    app = route_app()
    with TestClient(app) as client:
        refused = client.post("/update_weights_from_disk", json={})  # no session was ever opened
        assert refused.status_code == 400 and refused.json() == {
            "success": False,
            "message": "update_weights_from_disk must run between begin_weight_update() and end_weight_update()"}
        app.state.weight_update_session = True
        assert client.post("/update_weights_from_disk", json={}).json() == {"success": True}


# -- the probe

def test_a_two_token_sequence_is_probed_and_a_wrong_length_answer_is_named():
    from megarl.weights.probe import probe_sequences

    assert probe_sequences([[1, 2], [3]], 2, 5) == [[1, 2]]
    p = WeightProbe([[1, 2, 3], [4, 5]], 0.1)
    assert p.expected is None and p.version is None
    p.expect([torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])], 1)
    assert p.compare("engine0", [[-1.0, -2.0]]) == Mismatch("engine0", float("inf"), float("inf"), 3)


def test_the_probe_compares_in_double_precision():
    p = WeightProbe([[1, 2]], 0.1)
    p.expect([torch.tensor([-1.0], dtype=torch.float64)], 1)
    p.expected = [torch.tensor([-1.0], dtype=torch.float64)]
    m = p.compare("e", [[-1.0000001]])  # 1e-7: below float32's resolution at 1.0 (1.19e-7)
    assert m.mean_abs == pytest.approx(1e-7, rel=1e-6)


def test_a_bucket_rebuilt_from_a_read_only_array_as_ray_hands_it_out_warns_nothing():
    import warnings

    import numpy as np

    from megarl.weights.buckets import _rebuild_bucket, flatten, unpack_bucket

    flat = flatten({"w": torch.arange(6.0).reshape(2, 3)})
    array = flat.data.numpy().copy()
    array.setflags(write=False)  # Ray's object store maps it read-only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rebuilt = _rebuild_bucket(array, flat.entries)
    assert torch.equal(unpack_bucket(rebuilt)["w"], torch.arange(6.0).reshape(2, 3)) and isinstance(array, np.ndarray)


def test_a_weight_version_is_a_step_number_and_none_given_is_0():
    from fastapi import HTTPException

    from megarl.weights.routes import version_of

    assert version_of({}) == 0 and version_of({"weight_version": None}) == 0
    assert version_of({"weight_version": "12"}) == 12 and version_of({"weight_version": 3}) == 3
    with pytest.raises(HTTPException) as error:
        version_of({"weight_version": "v2"})
    assert error.value.status_code == 400 and error.value.detail == (
        "weight_version 'v2': megarl's versions are step numbers")
