"""The GPU contract of colocated engines' memory and of restarts around a weight sync, checked on a
CPU: train ranks with simulated GPUs and servers that behave as SGLang 0.5.23 (tests/gpu_harness.py,
tests/sglang_double.py), driven by megarl's own Runtime.sync_weights and fleet. Each case failed
before its fix."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpu_harness import Layout, all_tensors, calls
from megarl.config import load_config
from megarl.rollout.engine import SamplingParams
from megarl.rollout.sglang import SGLangFleet
from megarl.weights.adapters import AdapterTransport
from megarl.weights.buckets import weight_checksums
from megarl.weights.group import GroupTransport
from megarl.weights.ipc import IpcTransport
from test_gpu_contract import engine_sums, generating, ipc_config, nccl_config, run  # noqa: F401 (run: the fixture)

pytestmark = pytest.mark.megatron  # megatron-core runs here: make test-compat runs these on its newest release too


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backup", [False, True], ids=["memory-saver", "weights-cpu-backup"])
def test_a_release_outside_a_sync_never_leaves_the_engines_on_wiped_weights(run, backup):
    """A checkpoint's save releases the colocated engines' memory, weights included, outside a
    sync. Without --enable-weights-cpu-backup SGLang's resume maps fresh pages (the double turns
    the weights to NaN): before the fix the next step generated on them. Now the trainer's weights
    are synced again before generation; with the backup they come back from host memory."""
    layout = Layout(tp=2, dp=2, pp=1)
    extra = ["rollout.sglang.extra_args=[--enable-weights-cpu-backup]"] if backup else []
    r = run(ipc_config(layout, *extra), IpcTransport, layout, ["0", "1", "2", "3"], [["0", "1"], ["2", "3"]])
    r.runtime.sync_weights(version=1)
    r.runtime.for_training()  # _save: the engines release everything, the trainer wakes
    r.runtime.for_generation()  # the next step's generation
    want = weight_checksums(sorted(all_tensors(layout.pp).items()))
    assert [engine_sums(u) for u in r.urls()] == [want, want]
    loads = [c for c in calls(r.urls()[0]) if c["route"] == "/update_weights_from_tensor"]
    assert len(loads) == 2 * (1 if backup else 2)  # two buckets a sync; a second sync only without the backup
    assert asyncio.run(r.fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=1))).weight_version == 1


@pytest.mark.timeout(300)
def test_an_engine_that_dies_in_the_end_of_sync_resume_comes_back_with_the_trainers_weights(run, tmp_path):
    """Engine 1 dies when the sync's end resumes its KV cache. Before the fix the fleet restarted
    it and sent the fresh engine resume_memory(kv_cache, cuda_graph), tags it never released:
    SGLang's scheduler fails that (the double answers 500), and the run stopped. Now the fresh
    engine gets no resume, and since the ipc transport keeps no copy to reload, the trainer's
    weights are synced again: both engines end on them."""
    layout = Layout(tp=2, dp=2, pp=1)
    r = run(ipc_config(layout), IpcTransport, layout, ["0", "1", "2", "3"], [["0", "1"], ["2", "3"]],
            engine_args=[[], ["--exit-on-resume", f"kv_cache={tmp_path / 'died'}"]])
    r.runtime.for_training()  # after a generation: the engines release everything
    r.runtime.sync_weights(version=1)
    assert (tmp_path / "died").exists() and r.fleet.metrics()["rollout/engine_restarts"] == 1
    want = weight_checksums(sorted(all_tensors(layout.pp).items()))
    assert [engine_sums(u) for u in r.urls()] == [want, want]
    out = asyncio.run(r.fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=1)))
    assert out.weight_version == 1


@pytest.mark.timeout(300)
def test_a_generation_kept_across_a_long_sync_is_not_taken_for_a_stalled_engine(run):
    """Partial rollouts (keep): a generation in flight when a sync pauses the engines outlives
    cluster.liveness.progress_timeout_s. Before the fix its health check went to the paused engine,
    which SGLang parks and fails after 20 s (here the double fails it after 3 s, past the fleet's
    2 s health timeout): the fleet restarted a healthy engine mid-sync. Now no health check runs
    while a sync holds the engines paused."""
    from dataclasses import replace

    from megarl.config_cluster import LivenessConfig

    layout = Layout(tp=1, dp=1, pp=2)
    r = run(nccl_config(), GroupTransport, layout, [], [["4"], ["5"]], token_s=0.05,
            engine_args=[["--health-park-s", "3"]] * 2)
    fleet = SGLangFleet(r.entries, replace(r.runtime.cfg.rollout.sglang, health_timeout_s=2.0),
                        liveness=LivenessConfig(progress_timeout_s=1.0))
    kept = generating(fleet, 60)  # 3 s of tokens
    asyncio.run(fleet.begin_weight_update())
    time.sleep(2.5)  # a sync longer than the progress deadline
    asyncio.run(fleet.end_weight_update())
    out = kept.result(timeout=60)
    assert (len(out.token_ids), out.finish_reason) == (60, "length")
    assert fleet.metrics()["rollout/engine_restarts"] == 0
    assert not [c for u in r.urls() for c in calls(u) if c["route"] == "/health_generate" and c["paused"]]


@pytest.mark.timeout(300)
def test_an_engine_restarted_before_the_push_starts_next_to_a_sleeping_trainer(run, tmp_path):
    """Engine 1 dies when the sync brings its weights back, before the push: while the trainer
    still holds the weights it is about to push. SGLang sizes a starting engine's KV cache from the
    memory free then; next to the trainer's weights the cache comes out smaller than planned, or
    not at all for a large model. Before the fix the restart ran right there; now the trainer's
    weights leave the GPU for the restart and come back for the push."""
    layout = Layout(tp=2, dp=2, pp=1)
    r = run(ipc_config(layout), IpcTransport, layout, ["0", "1", "2", "3"], [["0", "1"], ["2", "3"]],
            engine_args=[[], ["--exit-on-resume", f"weights={tmp_path / 'died'}"]])
    trainer = r.runtime.worker
    r.runtime.for_training()  # after a generation: the engines release everything
    r.runtime.sync_weights(version=1)
    assert (tmp_path / "died").exists() and r.fleet.metrics()["rollout/engine_restarts"] == 1
    assert [name for name, _ in trainer.calls] == ["sleep all but the weights", "sleep", "wake the weights", "sleep"]
    (restarted,) = r.entries[1][1].restarted_at
    assert trainer.calls[1][1] <= restarted <= trainer.calls[2][1]  # the trainer fully asleep meanwhile
    want = weight_checksums(sorted(all_tensors(layout.pp).items()))
    assert [engine_sums(u) for u in r.urls()] == [want, want]


@pytest.mark.timeout(300)
def test_colocated_engines_serving_adapters_get_back_the_kv_cache_they_released(run, tmp_path):
    """actor.lora.sync=adapter, colocated: the engines keep the base on the GPU and release their
    KV cache and CUDA graphs alone for training, outside any sync (install_probe's release, a
    checkpoint's). Before the fix the resume before generation asked each engine for all three
    tags, the fleet resumed none (no engine had released its weights) and took the memory for
    back: the next generation ran on an unmapped KV cache, which kills SGLang (and the double),
    and the fleet restarted both engines. Now each engine gets back what it released."""
    layout = Layout(tp=2, dp=2, pp=1)
    cfg = load_config(None, ["model.path=m", "rollout.engine=sglang", "rollout.mode=colocated",
                             "cluster.gpus_per_node=4", "rollout.tensor_parallel_size=2", "actor.backend=megatron",
                             "actor.parallel.tensor_model_parallel_size=2", "actor.lora.r=4",
                             "actor.lora.sync=adapter", f"sync.disk_dir={tmp_path / 'adapters'}"])
    r = run(cfg, AdapterTransport, layout, ["0", "1", "2", "3"], [["0", "1"], ["2", "3"]])

    async def one_on_each_engine():  # the second request goes to the engine with none in flight
        return await asyncio.gather(*[r.fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=1)) for _ in range(2)])

    for _ in range(2):  # install_probe's release, then a checkpoint's
        r.runtime.for_training()
        r.runtime.for_generation()
        outs = asyncio.run(one_on_each_engine())
        assert [(len(o.token_ids), o.finish_reason) for o in outs] == [(1, "length")] * 2
    assert r.fleet.metrics()["rollout/engine_restarts"] == 0
    for url in r.urls():
        served = calls(url)
        for route in ("/release_memory_occupation", "/resume_memory_occupation"):
            assert [sorted(c["tags"]) for c in served if c["route"] == route] == [["cuda_graph", "kv_cache"]] * 2
        assert len([c for c in served if c["route"] == "/generate"]) == 2
