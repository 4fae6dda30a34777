"""The GPU contract of the weight sync, on CPU: train ranks with simulated GPUs (tests/gpu_harness.py)
and servers that behave as SGLang 0.5.23 does (tests/sglang_double.py), driven by megarl's own
Runtime.sync_weights, fleet and transports. Each case below failed before its fix."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from megarl.config import load_config
from megarl.rollout.engine import SamplingParams
from megarl.rollout.sglang import SGLangFleet
from megarl.weights.group import GroupTransport
from megarl.weights.buckets import weight_checksums
from megarl.weights.ipc import IpcTransport, ipc_plan
from gpu_harness import HarnessRuntime, Layout, ProcessRanks, all_tensors, calls, handle_dir, start_engines

pytestmark = pytest.mark.timeout(300)


def ipc_config(layout: Layout):
    return load_config(None, ["rollout.engine=sglang", "sync.transport=ipc", "rollout.mode=colocated",
                              "cluster.gpus_per_node=4", "rollout.tensor_parallel_size=2", "sync.bucket_mb=1",
                              "sync.verify=true", "actor.backend=megatron",
                              f"actor.parallel.tensor_model_parallel_size={layout.tp}",
                              f"actor.parallel.pipeline_model_parallel_size={layout.pp}"])


def nccl_config():
    return load_config(None, ["rollout.engine=sglang", "rollout.sglang.server=embedded", "sync.transport=nccl",
                              "sync.bucket_mb=1", "sync.verify=true", "rollout.sglang.startup_timeout_s=60",
                              "actor.backend=megatron", "actor.parallel.pipeline_model_parallel_size=2"])


class Run:
    """Ranks, engines and a runtime; everything stopped at the end."""

    def __init__(self, cfg, transport_class, layout: Layout, rank_gpus, engine_gpus, holds=None, deadline_s=60.0):
        self.entries, self.procs = start_engines(engine_gpus, holds)
        self.ranks = ProcessRanks(layout, rank_gpus, handle_dir(), deadline_s)
        self.fleet = SGLangFleet(self.entries, cfg.rollout.sglang)
        self.runtime = HarnessRuntime(cfg, self.fleet, self.ranks, transport_class(cfg, self.fleet), layout.pp)

    def urls(self) -> list[str]:
        return [e[2] for e in self.entries]

    def close(self) -> None:
        self.ranks.stop()
        for proc in self.procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def run():
    made = []

    def make(*args, **kwargs):
        made.append(Run(*args, **kwargs))
        return made[-1]
    yield make
    for r in made:
        r.close()


def engine_sums(url: str) -> dict[str, str]:
    return httpx.get(url + "/weight_checksums", timeout=10).json()


@pytest.mark.parametrize("layout", [Layout(tp=2, dp=2, pp=1), Layout(tp=2, dp=1, pp=2)], ids=["pp1", "pp2"])
def test_colocated_ipc_gives_each_engine_tp_rank_a_handle_from_its_own_gpu(run, layout):
    # 2 engines x TP 2 over 4 simulated GPUs; train rank r on GPU r. Before the fix, engine 1
    # got handles made on GPU 0 (which it cannot see), and with PP = 2 engine 0 lacked stage 1.
    r = run(ipc_config(layout), IpcTransport, layout, ["0", "1", "2", "3"], [["0", "1"], ["2", "3"]])
    r.runtime.sync_weights(version=1)  # sync.verify compares engine 0 with the trainer
    want = weight_checksums(sorted(all_tensors(layout.pp).items()))
    assert [engine_sums(u) for u in r.urls()] == [want, want]
    loads = [c for u in r.urls() for c in calls(u) if c["route"] == "/update_weights_from_tensor"]
    # a stage's 983,072 bytes fit one 1 MiB bucket, sent as two (bf16, fp32): 2 engines x stages x 2
    assert len(loads) == 2 * layout.pp * 2


def test_engines_get_every_memory_kind_back_before_generation_continues(run):
    layout = Layout(tp=2, dp=2, pp=1)
    r = run(ipc_config(layout), IpcTransport, layout, ["0", "1", "2", "3"], [["0", "1"], ["2", "3"]])
    r.runtime.release_engine_memory()
    released = [c["tags"] for u in r.urls() for c in calls(u) if c["route"] == "/release_memory_occupation"]
    assert [sorted(t) for t in released] == [["cuda_graph", "kv_cache", "weights"]] * 2  # by name, all three
    r.runtime.sync_weights(version=2)
    for url in r.urls():
        served = calls(url)
        resumed = [c["tags"] for c in served if c["route"] == "/resume_memory_occupation"]
        assert resumed == [["weights"], ["kv_cache", "cuda_graph"]]  # weights before loading, the rest after
        (cont,) = [c for c in served if c["route"] == "/continue_generation"]
        assert cont["released"] == []  # nothing still released when decoding continues
        first_resume = min(c["time"] for c in served if c["route"] == "/resume_memory_occupation")
        assert r.ranks.freed_at and r.ranks.freed_at[0] <= first_resume  # the trainer's cache freed first
    out = asyncio.run(r.fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=1)))
    assert out.token_ids == [7] and out.weight_version == 2


def test_an_engine_gpu_without_a_train_rank_is_refused_by_name():
    layout = Layout(tp=1, dp=2, pp=1)

    class Server:
        name, url, tp, node, gpus = "engine1", "http://x", 2, "node0", ("1", "5")
    with pytest.raises(RuntimeError, match=r"TP rank 1 of engine engine1 runs on GPU 5 of node node0, where no train"):
        ipc_plan(layout.places(["0", "1"]), [Server])


def test_ipc_plan_pairs_each_tp_rank_with_the_train_rank_on_its_gpu():
    layout = Layout(tp=2, dp=1, pp=2)  # ranks 0, 1: stage 0; 2, 3: stage 1

    class Engine0:
        name, url, tp, node, gpus = "engine0", "http://a", 2, "node0", ("2", "3")

    class Engine1:
        name, url, tp, node, gpus = "engine1", "http://b", 2, "node0", ("1", "0")  # TP 0 on GPU 1
    leads, makers = ipc_plan(layout.places(["0", "1", "2", "3"]), [Engine0, Engine1])
    assert leads == {0: [], 1: [("http://b", [1, 0])], 2: [("http://a", [2, 3])], 3: []}
    assert makers == {0, 1, 2, 3}


HOLDS = [["megarl-sync-rank0=1.5"], ["megarl-sync-rank1=1.5"]]  # engine 0 takes stage 1 first, engine 1 stage 0


def test_nccl_with_two_stages_and_two_engines_pushes_the_stages_in_turn(run):
    layout = Layout(tp=1, dp=1, pp=2)
    r = run(nccl_config(), GroupTransport, layout, [], [["4"], ["5"]], holds=HOLDS)
    r.runtime.sync_weights(version=1)
    want = weight_checksums(sorted(all_tensors(2).items()))
    assert [engine_sums(u) for u in r.urls()] == [want, want]
    for url in r.urls():  # and never a bucket of mixed dtypes (SGLang rebuilds it from names, dtypes, shapes)
        received = [c["names"] for c in calls(url) if c["route"] == "/update_weights_from_distributed"]
        tensors = all_tensors(2)
        assert all(len({tensors[n].dtype for n in names}) == 1 for names in received)


def test_the_harness_catches_the_nccl_ordering_deadlock(run, monkeypatch):
    # the same run with every stage pushed at once (the code before the fix): each engine waits
    # in the other stage's broadcast, and the sync never ends
    monkeypatch.setattr(GroupTransport, "stages_in_turn", False)
    layout = Layout(tp=1, dp=1, pp=2)
    r = run(nccl_config(), GroupTransport, layout, [], [["4"], ["5"]], holds=HOLDS, deadline_s=15.0)
    with pytest.raises(TimeoutError, match="did not answer within 15"):
        r.runtime.sync_weights(version=1)
