"""Weight sync (megarl.weights): flat buckets, checksums, the engine paused around a sync, and a
TP=2 x PP=2 megatron trainer synced into the embedded engine bit-exactly."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megarl.weights.buckets import FlatBucket, TensorEntry, compare_checksums, pack_buckets, send_flat, \
    unpack_bucket, verify_engine, weight_checksums
from megarl.weights.inprocess import load_into_engine
from megarl.weights.transport import RankPlace


def test_buckets_pack_in_order_aligned_and_unpack_exactly():
    # a limit of 80 bytes; every tensor starts at a multiple of 16 bytes
    tensors = [("a", torch.arange(10, dtype=torch.float32)),  # 40 bytes, takes 48
               ("b", torch.tensor([1, 2], dtype=torch.int64)),  # 16: 48 + 16 = 64 fits
               ("c", torch.randn(5, 5).to(torch.bfloat16)),  # 50, takes 64: 64 + 64 > 80, a new bucket
               ("d", torch.tensor(True)),  # 0-dim bool, 1 byte, takes 16: 64 + 16 = 80 fits
               ("e", torch.randn(30))]  # 120 bytes > the limit: alone
    buckets = list(pack_buckets(tensors, bucket_bytes=80))
    assert [b.names for b in buckets] == [["a", "b"], ["c", "d"], ["e"]]
    assert [(e.offset, e.nbytes) for e in buckets[0].entries] == [(0, 40), (48, 16)]
    assert [(e.offset, e.nbytes) for e in buckets[1].entries] == [(0, 50), (64, 1)]
    assert [b.data.numel() for b in buckets] == [64, 80, 128]
    out = {n: t for b in buckets for n, t in unpack_bucket(b).items()}
    for name, tensor in tensors:
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name
    with pytest.raises(ValueError, match="sync.bucket_mb"):
        next(pack_buckets(tensors, 0))


def test_checksums_see_one_flipped_bit():
    t = torch.randn(4, 4)
    flipped = t.clone()
    flipped.view(torch.int32)[2, 3] ^= 1  # the last mantissa bit of one entry
    a, b = weight_checksums([("w", t)]), weight_checksums([("w", flipped)])
    assert a == weight_checksums([("w", t.clone())]) and a != b
    assert compare_checksums(a, b) == ["w"]
    assert compare_checksums(a | {"only_trainer": "x"}, a | {"only_engine": "y"}) == ["only_engine", "only_trainer"]
    assert weight_checksums([("w", t.to(torch.bfloat16))])["w"].startswith("bfloat16 (4, 4) ")


class RecordingEngine:
    """A test double: records the calls; update_weights fails on a tensor named 'bad'."""

    def __init__(self):
        self.calls, self.loaded = [], {}

    async def pause(self):
        self.calls.append("pause")

    async def resume(self):
        self.calls.append("resume")

    async def flush_cache(self):
        self.calls.append("flush")

    async def update_weights(self, buckets, version):
        for bucket in buckets:
            if "bad" in bucket:
                raise KeyError("bad")
            self.loaded.update(bucket)
            self.calls.append(f"load v{version}")

    async def weight_checksums(self):
        return weight_checksums(self.loaded.items())


def test_generation_is_paused_around_a_sync_and_resumes_after_a_failure():
    engine = RecordingEngine()
    buckets = pack_buckets([("x", torch.ones(3)), ("y", torch.zeros(2))], bucket_bytes=16)
    assert asyncio.run(load_into_engine(engine, buckets, version=7)) == 2
    assert engine.calls == ["pause", "load v7", "load v7", "flush", "resume"]
    asyncio.run(verify_engine(engine, weight_checksums([("x", torch.ones(3)), ("y", torch.zeros(2))])))
    with pytest.raises(RuntimeError, match=r"differ from the trainer's in 1 tensors, e.g. \['y'\]"):
        asyncio.run(verify_engine(engine, weight_checksums([("x", torch.ones(3)), ("y", torch.ones(2))])))
    engine.calls.clear()
    with pytest.raises(KeyError):
        asyncio.run(load_into_engine(engine, [{"bad": torch.ones(1)}], version=8))
    assert engine.calls == ["pause", "resume"]


@pytest.mark.parametrize("family, layout, world", [
    ("llama", ["actor.parallel.tensor_model_parallel_size=2", "actor.parallel.pipeline_model_parallel_size=2"], 4),
    # Qwen3-MoE at EP=2: the source rank sends every expert, gathered from both ranks, by checkpoint name
    ("qwen3_moe", ["actor.parallel.expert_model_parallel_size=2"], 2)])
@pytest.mark.megatron
def test_megatron_trainer_syncs_into_the_embedded_engine_exactly(tmp_path, family, layout, world):
    from megarl.backends.torch.logprobs import token_log_probs
    from megarl.rollout.local import LocalEngine
    from megatron_cases import trained_export
    from megatron_dist import run_distributed
    from test_megatron_worker import update_batch
    from tiny_models import tiny_hf_model

    tied = family == "llama"
    model = tiny_hf_model(family, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    update, batch = update_batch(model, seed=1), update_batch(model, seed=2)
    results = run_distributed(world, trained_export, str(tmp_path), layout, update, batch, 20_000)
    buckets = [FlatBucket(data, [TensorEntry(*e) for e in entries]) for sent, _, _ in results for data, entries in sent]
    assert len(buckets) > 4  # several buckets (from each of the stages)
    trainer_checksums, trainer_log_probs = results[0][1], results[0][2]
    if family == "qwen3_moe":
        assert "model.layers.3.mlp.experts.5.down_proj.weight" in trainer_checksums

    engine_model = tiny_hf_model(family, seed=7, tie_word_embeddings=tied)  # other weights until the sync
    engine = LocalEngine(engine_model, eos_token_ids=[])

    async def sync():
        await load_into_engine(engine, buckets, version=1)
        await verify_engine(engine, trainer_checksums)  # bit-exact, every tensor
        await engine.close()

    asyncio.run(sync())
    initial = dict(model.state_dict())
    assert any(not torch.equal(t, initial[n]) for n, t in engine_model.state_dict().items())  # trained weights came
    with torch.no_grad():
        engine_log_probs, _ = token_log_probs(engine_model, batch.input_ids, batch.attention_mask)
    real = batch.attention_mask.bool().clone()
    real[:, 0] = False
    torch.testing.assert_close(engine_log_probs[real], trainer_log_probs[real], rtol=0, atol=1e-5)


def test_flat_buckets_are_sent_two_at_a_time_and_survive_pickling():
    import pickle

    log, loaded = [], {}

    def send(flat):
        log.append(f"send {flat.names}")
        return pickle.loads(pickle.dumps(flat))  # what crossing a process does to it

    def wait(flat):
        log.append(f"wait {flat.names}")
        loaded.update(unpack_bucket(flat))

    groups = [{"a": torch.ones(2)}, {"b": torch.arange(3)}, {"c": torch.zeros(1, dtype=torch.bfloat16)}]
    assert send_flat(groups, send, wait, depth=2) == 3
    assert log == ["send ['a']", "send ['b']", "wait ['a']", "send ['c']", "wait ['b']", "wait ['c']"]
    for group in groups:
        for name, tensor in group.items():
            assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)


class SyncRecorder:
    """The parts of a weight sync (train ranks, engine, transport), recording the order of calls."""

    def __init__(self, fail_push: bool = False):
        self.calls, self.fail_push = [], fail_push

    def places(self):
        return [RankPlace(0, "node0", "", 0, True)]

    def free_cache(self):
        self.calls.append("free_cache")

    def push(self, bucket_bytes, version, stage=None):
        self.calls.append("push")
        if self.fail_push:
            raise RuntimeError("push failed")
        return 1

    async def begin_weight_update(self):
        self.calls.append("begin")

    async def end_weight_update(self):
        self.calls.append("end")

    stages_in_turn = False

    def connect(self, ranks):
        self.calls.append("connect")

    def finish(self, version):
        self.calls.append("finish")


@pytest.mark.parametrize("fail_push", [False, True])
def test_the_push_buffers_are_freed_before_the_engines_take_their_memory_back(fail_push):
    """A colocated engine resumes its KV cache and CUDA graphs in end_weight_update: the train
    ranks give back what the push allocated (buckets, IPC copies) before it, also after a failure."""
    from megarl.config import load_config
    from megarl.runtime.base import Runtime

    class Recorded(Runtime):
        release_engine_memory = shutdown = lambda self: None

    parts = SyncRecorder(fail_push)
    runtime = Recorded()
    runtime.cfg = load_config(None, ["sync.verify=false"])
    runtime.ranks = runtime.engine = runtime.transport = parts
    if fail_push:
        with pytest.raises(RuntimeError, match="push failed"):
            runtime.sync_weights(3)
    else:
        runtime.sync_weights(3)
    pushed = ["push"] if fail_push else ["push", "finish"]
    assert parts.calls == ["free_cache", "begin", "connect", *pushed, "free_cache", "end"]


@pytest.mark.parametrize("engine_sums, error", [
    ({"w": "float32 (2,) 00000001"}, None),  # the engine holds what the trainer pushed
    ({"w": "float32 (2,) 0000000f"}, r"differ from the trainer's in 1 tensors, e.g. \['w'\]"),
    ({}, "the engine reported no weight checksums"),  # nothing compared is not a pass
])
def test_sync_verify_compares_the_engine_with_the_trainer_after_every_successful_sync(engine_sums, error):
    from megarl.config import load_config
    from megarl.runtime.base import Runtime

    class Recorded(Runtime):
        release_engine_memory = shutdown = lambda self: None

    class Worker:
        def weight_checksums(self):
            return {"w": "float32 (2,) 00000001"}

    parts = SyncRecorder()

    async def engine_checksums():
        parts.calls.append("engine checksums")
        return engine_sums

    parts.weight_checksums = engine_checksums
    runtime = Recorded()
    runtime.cfg = load_config(None, ["sync.verify=true", "sync.probe.enable=false"])
    runtime.ranks = runtime.engine = runtime.transport = parts
    runtime.worker = Worker()
    if error:
        with pytest.raises(RuntimeError, match=error):
            runtime.sync_weights(3)
    else:
        runtime.sync_weights(3)
    # read after the engines are back (end), once
    assert parts.calls[-2:] == ["end", "engine checksums"]
