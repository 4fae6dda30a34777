"""The GPU contract, checked on a CPU: what the GPU-only paths must do, tested through the same
code with the GPU's answers (CUDA present, kernels importable, FP8 parameters, GPU identities,
SGLang's server semantics) given by hand."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

import pytest
import torch

from gpu_harness import HarnessRuntime, Layout, ProcessRanks, all_tensors, calls, start_engines
from megatron_dist import run_distributed
from tiny_models import tiny_hf_model

from megarl.config import load_config
from megarl.driver_loop import run_async
from megarl.rollout.engine import SamplingParams
from megarl.rollout.sglang import SGLangFleet
from megarl.weights.buckets import weight_checksums
from megarl.weights.group import GroupTransport
from megarl.weights.ipc import IpcTransport, ipc_plan

pytestmark = pytest.mark.megatron  # megatron-core runs here: make test-compat runs these on its newest release too


# -- Megatron on GPUs: fused-kernel flags (FP8 padding and parameters: tests/test_gpu_contract_fp8.py)

@pytest.mark.parametrize("cuda, kernels, explicit_mask, cp, want", [
    (True, True, False, 1, True),
    (True, False, False, 1, False),  # a GPU without Apex's kernels: megatron would fail importing them
    (False, True, False, 1, False),
    (True, True, True, 1, False),  # packed sequences' own mask
    (True, True, False, 2, False),  # context parallelism's own mask
])
def test_fused_softmax_only_with_its_kernels(cuda, kernels, explicit_mask, cp, want):
    from megarl.backends.megatron.model import use_fused_softmax

    assert use_fused_softmax(cuda=cuda, kernels=kernels, explicit_mask=explicit_mask, cp=cp) is want


@pytest.fixture
def tiny_spec(tmp_path):
    from megarl.models import ModelSpec

    tiny_hf_model("qwen2").save_pretrained(tmp_path)
    return ModelSpec.from_hf(tmp_path)


def test_local_layers_build_on_a_gpu_without_apex(monkeypatch, tiny_spec):
    """The config a GPU without Apex gets builds megatron's local RMSNorm (which refuses
    persist_layer_norm) and picks the unfused softmax without importing the missing kernels."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megarl.backends.megatron import model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(model, "fused_softmax_available", lambda: False)
    config = model.transformer_config(tiny_spec, model.Layout(), dtype="bfloat16")
    assert not config.persist_layer_norm and not config.masked_softmax_fusion
    WrappedTorchNorm(config, hidden_size=tiny_spec.hidden_size, eps=tiny_spec.norm_eps)
    softmax = FusedScaleMaskSoftmax(input_in_fp16=config.fp16, input_in_bf16=config.bf16,
                                    attn_mask_type=AttnMaskType.causal,
                                    scaled_masked_softmax_fusion=config.masked_softmax_fusion,
                                    mask_func=lambda scores, mask: scores, softmax_in_fp32=True, scale=None)
    assert not softmax.is_kernel_available(None, 1, 4, 32, 32)  # shapes the fused kernel takes


def test_fused_softmax_on_a_gpu_with_its_kernels(monkeypatch, tiny_spec):
    from megarl.backends.megatron import model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(model, "fused_softmax_available", lambda: True)
    assert model.transformer_config(tiny_spec, model.Layout(), dtype="bfloat16").masked_softmax_fusion
    assert not model.transformer_config(tiny_spec, model.Layout(), dtype="bfloat16",
                                        explicit_mask=True).masked_softmax_fusion


@pytest.mark.parametrize("tp, cp, want", [
    (1, 1, {}),  # data and pipeline parallelism only
    (2, 1, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    (1, 2, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    (4, 2, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
])
def test_rank_environment(tp, cp, want):
    from megarl.backends.megatron.model import rank_environment

    assert rank_environment(tp, cp) == want


class _CudaAsked(Exception):
    pass


def test_a_train_rank_sets_its_environment_before_cuda_starts(monkeypatch):
    import megarl.backends.megatron.worker  # noqa: F401 (imported before CUDA is faked)
    from megarl.runtime import ray_actors

    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "CUDA_DEVICE_MAX_CONNECTIONS"):
        monkeypatch.delenv(key, raising=False)  # the rank sets them; restored after the test
    seen = {}

    def cuda_is_available():
        seen.update(os.environ)
        raise _CudaAsked

    monkeypatch.setattr(torch.cuda, "is_available", cuda_is_available)
    cfg = SimpleNamespace(actor=SimpleNamespace(parallel=SimpleNamespace(tensor_model_parallel_size=2,
                                                                         context_parallel_size=1)))
    with pytest.raises(_CudaAsked):
        ray_actors._megatron_worker(cfg, 1, 0, 2, ("127.0.0.1", 1))
    assert seen.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"


class _FakeFloat8:
    """Stands in for Transformer Engine's QuantizedTensor: FP8 codes and a scale, in bf16 when
    dequantised."""

    def __init__(self, codes: torch.Tensor, scale: float):
        self.codes, self.scale = codes, scale

    def dequantize(self) -> torch.Tensor:
        return (self.codes.float() * self.scale).to(torch.bfloat16)


def test_export_reads_fp8_parameters_dequantised(monkeypatch):
    from megatron.core import fp8_utils

    from megarl.backends.megatron.model import high_precision

    monkeypatch.setattr(fp8_utils, "HAVE_TE_FP8_TENSOR_CLASS", True)
    monkeypatch.setattr(fp8_utils, "FP8_TENSOR_CLASS", _FakeFloat8)
    fp8 = _FakeFloat8(torch.tensor([[2, -4], [8, 0]], dtype=torch.int8), 0.25)
    values = high_precision(fp8)
    assert values.dtype == torch.bfloat16 and values.tolist() == [[0.5, -1.0], [2.0, 0.0]]
    plain = torch.nn.Parameter(torch.tensor([0.5, 1.5], dtype=torch.bfloat16))
    kept = high_precision(plain)  # a plain parameter stays in its dtype (torch's own dequantize gives float32)
    assert kept.dtype == torch.bfloat16 and kept.tolist() == [0.5, 1.5] and not kept.requires_grad


def fp8_masters_after_loading(hf_dir: str) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """On one rank: a bf16 model whose linear weights act as Transformer Engine's FP8
    parameters do for megatron's distributed optimizer (a high-precision copy of their random
    initial value that the optimizer builds its FP32 masters from), the HF weights loaded, the
    optimizer built as the worker builds it. Returns (name, master, loaded weight, initial
    value) of each such shard, flat, in float32."""
    from megatron.core.optimizer import distrib_optimizer

    from megarl.backends.megatron.model import Layout, build_model, initialize, load_hf_weights
    from megarl.backends.megatron.step import wrap_for_training
    from megarl.config import OptimConfig
    from megarl.models import ModelSpec

    spec = ModelSpec.from_hf(hf_dir)
    initialize(Layout(), seed=0)
    (chunk,) = build_model(spec, Layout(), dtype="bfloat16")
    initial = {}
    for name, param in chunk.named_parameters():
        if "linear" in name and name.endswith("weight"):  # what Transformer Engine's fp8_model_init makes FP8
            held = [torch.randn(param.shape, generator=torch.Generator().manual_seed(len(initial))).to(param.dtype)]
            param.get_high_precision_init_val = lambda held=held: held[0]
            param.clear_high_precision_init_val = lambda held=held: held.__setitem__(0, None)
            initial[param] = (name, held[0].clone())
    distrib_optimizer.is_float8tensor = lambda tensor: hasattr(tensor, "get_high_precision_init_val")
    load_hf_weights([chunk], spec, hf_dir)
    _, optimizer = wrap_for_training([chunk], OptimConfig(), fp8_recipe="delayed")
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for params, masters in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
            for param, master in zip(params, masters):
                if param in initial:
                    span = opt._get_model_param_range_map(param)["param"]
                    name, init = initial[param]
                    out.append((name, master.detach().clone(), param.detach().float().view(-1)[span.start:span.end],
                                init.float().view(-1)[span.start:span.end]))
    return out


def test_fp8_master_weights_start_from_the_loaded_weights(tmp_path):
    """fp8_param_gather: the first optimizer step writes the FP32 masters back to the weights,
    so the masters must hold the loaded HF weights, not the random initialisation."""
    model = tiny_hf_model("qwen2")
    model.save_pretrained(tmp_path)
    (shards,) = run_distributed(1, fp8_masters_after_loading, str(tmp_path))
    assert len(shards) == 4 * model.config.num_hidden_layers  # linear_qkv, linear_proj, linear_fc1, linear_fc2
    for name, master, loaded, init in shards:
        assert torch.equal(master, loaded), name
        assert not torch.equal(master, init), name


# -- The weight sync: train ranks with simulated GPUs (tests/gpu_harness.py) and servers that
# behave as SGLang 0.5.23 (tests/sglang_double.py), driven by megarl's own Runtime.sync_weights,
# fleet and transports. Each case failed before its fix (checked by hand once; the deadlock case
# keeps the old ordering under test).



def ipc_config(layout: Layout, *extra: str):
    # the doubles answer megarl's /weight_checksums as its embedded servers do (sync.verify)
    return load_config(None, [*extra, "rollout.engine=sglang", "rollout.sglang.server=embedded", "sync.transport=ipc",
                              "rollout.mode=colocated",
                              "cluster.gpus_per_node=4", "rollout.tensor_parallel_size=2", "sync.bucket_mb=1",
                              "sync.verify=true", "actor.backend=megatron",
                              f"actor.parallel.tensor_model_parallel_size={layout.tp}",
                              f"actor.parallel.pipeline_model_parallel_size={layout.pp}",
                              f"actor.parallel.expert_model_parallel_size={layout.ep}"])


def nccl_config():
    return load_config(None, ["rollout.engine=sglang", "rollout.sglang.server=embedded", "sync.transport=nccl",
                              "sync.bucket_mb=1", "sync.verify=true", "rollout.sglang.startup_timeout_s=60",
                              "actor.backend=megatron", "actor.parallel.pipeline_model_parallel_size=2"])


class Run:
    """Ranks, engines and a runtime; everything stopped at the end."""

    def __init__(self, work: Path, cfg, transport_class, layout: Layout, rank_gpus, engine_gpus, holds=None,
                 deadline_s=60.0, hf_dir: str | None = None, token_s: float = 0.0, engine_args=None):
        (work / "collectives").mkdir(parents=True)
        (work / "handles").mkdir()
        self.entries, self.procs = start_engines(engine_gpus, str(work / "collectives"), holds, token_s,
                                                 tuple(cfg.rollout.sglang.extra_args), engine_args)
        self.ranks = ProcessRanks(layout, rank_gpus, str(work / "handles"), deadline_s, hf_dir=hf_dir)
        self.fleet = SGLangFleet(self.entries, cfg.rollout.sglang)
        self.exported = hf_tensors(hf_dir) if hf_dir else all_tensors(layout.pp)
        self.runtime = HarnessRuntime(cfg, self.fleet, self.ranks, transport_class(cfg, self.fleet), self.exported)

    def urls(self) -> list[str]:
        return [e[2] for e in self.entries]

    def close(self) -> None:
        self.ranks.stop()
        for proc in self.procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def run(tmp_path):
    made = []

    def make(*args, **kwargs):
        made.append(Run(tmp_path / f"run{len(made)}", *args, **kwargs))
        return made[-1]
    yield make
    for r in made:
        r.close()


def engine_sums(url: str) -> dict[str, str]:
    return httpx.get(url + "/weight_checksums", timeout=10).json()


def hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    """The HF model's tensors as its safetensors file holds them."""
    from safetensors.torch import load_file

    return load_file(os.path.join(hf_dir, "model.safetensors"))


@pytest.mark.timeout(300)
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


@pytest.mark.timeout(300)
def test_colocated_ipc_from_megarls_megatron_ranks(run, tmp_path):
    # the same flow from megarl's MegatronTrainWorker at TP 2 x PP 2 (ranks 0, 1: stage 0 on
    # GPUs 0, 1; ranks 2, 3: stage 1 on GPUs 2, 3): its TP gathers and per-stage export feed the
    # broadcasts, and both engines end on the HF model's own tensors, bit for bit
    tiny_hf_model("qwen2").save_pretrained(tmp_path)
    layout = Layout(tp=2, dp=1, pp=2)
    r = run(ipc_config(layout), IpcTransport, layout, ["0", "1", "2", "3"], [["0", "1"], ["2", "3"]],
            deadline_s=120.0, hf_dir=str(tmp_path))
    assert [p.is_source for p in r.ranks.places()] == [True, False, True, False]
    r.runtime.sync_weights(version=1)
    want = weight_checksums(sorted(hf_tensors(str(tmp_path)).items()))
    assert [engine_sums(u) for u in r.urls()] == [want, want]


@pytest.mark.timeout(300)
def test_colocated_ipc_from_megarls_megatron_ranks_with_expert_parallelism(run, tmp_path):
    # megarl's MegatronTrainWorker with EP 2 over two data-parallel ranks (rank 0 on GPU 0, rank 1
    # on GPU 1; one engine of TP 2 on both) and a tiny Qwen3-MoE of about 4 MB, so several 1 MiB
    # buckets. After each bucket every rank takes part in the ipc sender's broadcasts, and rank 1
    # (DP 1, no source) in the experts' EP gathers of rank 0's export: it must walk its export
    # bucket by bucket with rank 0. Before the fix it walked all of it at the first bucket, inside
    # an EP gather while rank 0 was in a broadcast: a deadlock, here a timeout after 30 s.
    tiny_hf_model("qwen3_moe", moe_intermediate_size=256).save_pretrained(tmp_path)
    layout = Layout(tp=1, dp=2, pp=1, ep=2)
    r = run(ipc_config(layout), IpcTransport, layout, ["0", "1"], [["0", "1"]], deadline_s=30.0,
            hf_dir=str(tmp_path))
    assert [p.is_source for p in r.ranks.places()] == [True, False]
    r.runtime.sync_weights(version=1)  # sync.verify compares the engine with the trainer
    tensors = hf_tensors(str(tmp_path))
    assert [engine_sums(u) for u in r.urls()] == [weight_checksums(sorted(tensors.items()))]
    loads = [c for c in calls(r.urls()[0]) if c["route"] == "/update_weights_from_tensor"]
    total = sum(t.numel() * t.element_size() for t in tensors.values())  # all float32: one piece per bucket
    assert total > 3 << 20 and len(loads) >= -(-total // (1 << 20))  # at least that many 1 MiB buckets


@pytest.mark.timeout(300)
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


@pytest.mark.timeout(300)
def test_the_trainer_sleeps_between_the_engines_weights_and_their_kv_cache_and_wakes_after_they_release(run):
    """Colocated on GPUs the trainer sleeps by default (trainer.sleep_during_generation): in a
    sync, all but its weights before the engines' weights come back (before the fix the engines'
    weights came back next to the trainer's gradients and Adam state: 78.6 of 79 usable GiB on the
    Qwen3-30B-A3B layout), its weights after they are loaded and before the KV cache and CUDA
    graphs come back; after the generation, it wakes only once every engine has released."""
    layout = Layout(tp=2, dp=2, pp=1)
    r = run(ipc_config(layout), IpcTransport, layout, ["0", "1", "2", "3"], [["0", "1"], ["2", "3"]])
    assert r.runtime.cfg.trainer_sleeps()
    trainer = r.runtime.worker
    r.runtime.for_training()  # after a generation: the engines release, the trainer is awake already
    r.runtime.sync_weights(version=2)
    r.runtime.for_generation()  # asleep already, the engines hold their memory: nothing more
    out = asyncio.run(r.fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=1)))
    assert out.weight_version == 2
    r.runtime.for_training()
    assert [name for name, _ in trainer.calls] == ["sleep all but the weights", "sleep", "wake"]
    state_slept, slept, woke = (t for _, t in trainer.calls)
    for url in r.urls():
        served = calls(url)
        resumed = [(c["tags"], c["time"]) for c in served if c["route"] == "/resume_memory_occupation"]
        assert [tags for tags, _ in resumed] == [["weights"], ["kv_cache", "cuda_graph"]]
        loaded = max(c["time"] for c in served if c["route"] == "/update_weights_from_tensor")
        # the trainer's state gone; the engines' weights back, loaded; the trainer's weights gone; KV back
        assert state_slept <= resumed[0][1] <= loaded <= slept <= resumed[1][1]
        released = [c["time"] for c in served if c["route"] == "/release_memory_occupation"]
        assert len(released) == 2 and released[1] <= woke  # the second release, after the generation: then awake


def test_an_engine_gpu_without_a_train_rank_is_refused_by_name():
    layout = Layout(tp=1, dp=2, pp=1)

    class Server:
        name, url, tp, node, gpus, rank_nodes = "engine1", "http://x", 2, "node0", ("1", "5"), ("node0",) * 2
    with pytest.raises(RuntimeError, match=r"TP rank 1 of engine engine1 runs on GPU 5 of node node0, where no train"):
        ipc_plan(layout.places(["0", "1"]), [Server])


def test_ipc_plan_pairs_each_tp_rank_with_the_train_rank_on_its_gpu():
    layout = Layout(tp=2, dp=1, pp=2)  # ranks 0, 1: stage 0; 2, 3: stage 1

    class Engine0:
        name, url, tp, node, gpus, rank_nodes = "engine0", "http://a", 2, "node0", ("2", "3"), ("node0",) * 2

    class Engine1:
        # TP 0 on GPU 1
        name, url, tp, node, gpus, rank_nodes = "engine1", "http://b", 2, "node0", ("1", "0"), ("node0",) * 2
    leads, makers = ipc_plan(layout.places(["0", "1", "2", "3"]), [Engine0, Engine1])
    assert leads == {0: [], 1: [("http://b", [1, 0])], 2: [("http://a", [2, 3])], 3: []}
    assert makers == {0, 1, 2, 3}


HOLDS = [["megarl-sync-rank0=1.5"], ["megarl-sync-rank1=1.5"]]  # engine 0 takes stage 1 first, engine 1 stage 0


def generating(fleet, tokens: int) -> concurrent.futures.Future:
    """One greedy request of `tokens` new tokens through the fleet, on a thread of its own, once
    it is running on an engine."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    out = pool.submit(asyncio.run, fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=tokens)))
    pool.shutdown(wait=False)
    deadline = time.monotonic() + 60
    while not any(kv_tokens(s.url) >= 3 + 3 for s in fleet.servers):  # the prompt's 3 and some made
        assert time.monotonic() < deadline and not out.done(), "the request made no tokens in 60 s"
        time.sleep(0.01)
    return out


def kv_tokens(url: str) -> int:
    """The tokens a double's requests hold, prompts included (its /v1/loads, as SGLang's)."""
    (load,) = httpx.get(url + "/v1/loads", timeout=10).json()["loads"]
    return load["num_used_tokens"]


@pytest.mark.timeout(300)
def test_nccl_with_two_stages_and_two_engines_pushes_the_stages_in_turn(run):
    # each token takes 50 ms, so a request is still decoding when a sync begins: SGLang then
    # refuses /flush_cache unless the engines are paused, and a paused engine holds the request
    layout = Layout(tp=1, dp=1, pp=2)
    r = run(nccl_config(), GroupTransport, layout, [], [["4"], ["5"]], holds=HOLDS, token_s=0.05)
    held = generating(r.fleet, 100)
    r.runtime.sync_weights(version=1)
    want = weight_checksums(sorted(all_tensors(2).items()))
    assert [engine_sums(u) for u in r.urls()] == [want, want]
    for url in r.urls():  # and never a bucket of mixed dtypes (SGLang rebuilds it from names, dtypes, shapes)
        received = [c["names"] for c in calls(url) if c["route"] == "/update_weights_from_distributed"]
        tensors = all_tensors(2)
        assert all(len({tensors[n].dtype for n in names}) == 1 for names in received)
        control = [c for c in calls(url) if c["route"] in ("/pause_generation", "/flush_cache", "/continue_generation")]
        assert [c["route"] for c in control] == ["/pause_generation", "/flush_cache", "/continue_generation"]
    assert sum(c.get("in_flight", 0) for u in r.urls() for c in calls(u)) == 1  # paused while it decoded
    out = held.result(timeout=60)  # held through the sync, then finished on the new weights
    assert (len(out.token_ids), out.finish_reason, out.weight_version) == (100, "length", 1)
    # partial rollouts: the request aborted before the next sync ends with the tokens it has
    aborted = generating(r.fleet, 100)
    run_async(r.fleet.abort_requests())
    out = aborted.result(timeout=60)
    assert 0 < len(out.token_ids) < 100 and out.finish_reason == "abort" and out.weight_version == 1
    r.runtime.sync_weights(version=2)


@pytest.mark.timeout(300)
def test_nccl_from_megarls_megatron_stages_into_two_engines(run, tmp_path):
    # megarl's MegatronTrainWorker at PP 2, engines forced into the order that deadlocked
    tiny_hf_model("qwen2").save_pretrained(tmp_path)
    layout = Layout(tp=1, dp=1, pp=2)
    r = run(nccl_config(), GroupTransport, layout, [], [["4"], ["5"]], holds=HOLDS, deadline_s=120.0,
            hf_dir=str(tmp_path))
    r.runtime.sync_weights(version=1)
    want = weight_checksums(sorted(hf_tensors(str(tmp_path)).items()))
    assert [engine_sums(u) for u in r.urls()] == [want, want]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_harness_catches_the_nccl_ordering_deadlock(run, monkeypatch):
    # the same run with every stage pushed at once (the code before the fix): each engine waits
    # in the other stage's broadcast, and the sync never ends
    monkeypatch.setattr(GroupTransport, "stages_in_turn", False)
    layout = Layout(tp=1, dp=1, pp=2)
    r = run(nccl_config(), GroupTransport, layout, [], [["4"], ["5"]], holds=HOLDS, deadline_s=15.0)
    with pytest.raises(TimeoutError, match="did not answer within 15"):
        r.runtime.sync_weights(version=1)
