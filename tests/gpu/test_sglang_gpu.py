"""One real SGLang server on a GPU (skipped where CUDA or SGLang is missing), launched with the
argv megarl gives a colocated engine (`server_command`): the flags as SGLang resolved them and
the KV cache they give, generation by token ids with log-probs against HF's, then weight updates
the ways the fleet sends them (disk, an NCCL update group, CUDA IPC handles), and the fleet's
release and resume of the engine's memory around a weight update. Each test names the rows of
the GPU status table it checks (`gpu_path`, tests/gpu/gpu_status.py).

The server runs on the last GPU; the trainer side of the tests on cuda:0 (NCCL refuses two ranks
on one device: that case needs two GPUs) or, for CUDA IPC, on the server's GPU (a handle opens
only on the GPU it was made on). Tolerance (bf16, as tests/gpu/test_megatron_gpu.py explains):
SGLang's kernels and HF's agree within 0.15 at worst and 0.03 on average over the tokens of a
greedy continuation.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
from types import SimpleNamespace

import httpx
import pytest
import torch

from megarl.http_auth import bearer
from megarl.rollout.engine import SamplingParams
from megarl.rollout.http import HTTPEngine
from megarl.rollout.sglang_launch import ServerProcess, free_port, server_command
from megarl.weights.buckets import group_tensors, hf_tensors
from in_this_process import InThisProcess
from tiny_models import reference_log_probs, tiny_tokenizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang (pip install '.[gpu]')")]
path = pytest.mark.gpu_path

PROMPT = [5, 6, 7, 8, 9]
MEM_FRACTION = 0.3
KEY = "gpu-test-key"  # the server is started with it, as the fleet starts its servers
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 128 * 2  # K and V x 2 layers x 2 KV heads x head_dim 512 / 4 x bf16


def small_model(vocab_size: int, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, eos_token_id=None, torch_dtype="bfloat16")
    return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


def two_dtypes(model) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors with the norms in fp32 (the same values): buckets of two dtypes, which
    the transports must split (an engine reads a flat bucket as one dtype)."""
    return [(name, t.float() if "norm" in name else t) for name, t in hf_tensors(model)]


def free_memory(gpu: int) -> int:
    torch.cuda.synchronize(gpu)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(gpu)[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from megarl.config import load_config

    root = tmp_path_factory.mktemp("sglang")
    tok = tiny_tokenizer()
    model = small_model(len(tok), seed=0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    cfg = load_config(None, [f"model.path={root / 'model'}", "model.dtype=bfloat16", "rollout.engine=sglang",
                             "cluster.launcher=ray", "cluster.gpus_per_node=1",
                             f"rollout.gpu_memory_utilization={MEM_FRACTION}", "trainer.seed=7"])
    gpu = torch.cuda.device_count() - 1
    free_at_start = free_memory(gpu)
    process = ServerProcess(server_command(cfg, colocated=True), "sglang0", log_dir=str(root), api_key=KEY,
                            env={"CUDA_VISIBLE_DEVICES": str(gpu)})
    process.start(timeout_s=900)
    yield SimpleNamespace(process=process, client=HTTPEngine(process.url, api_key=KEY), model=model, vocab=len(tok), gpu=gpu,
                          free_at_start=free_at_start, weight_bytes=sum(t.nbytes for _, t in hf_tensors(model)))
    process.stop()


def check_log_probs(client, model):
    out = asyncio.run(client.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)))
    want = reference_log_probs(model.cuda(), PROMPT, out.token_ids).cpu()
    diff = (torch.tensor(out.log_probs) - want.float()).abs()
    assert float(diff.max()) < 0.15 and float(diff.mean()) < 0.03, (float(diff.max()), float(diff.mean()))
    model.cpu()
    return out


@path("sglang_flags")
def test_launch_flags_as_sglang_resolved_them(server):
    """SGLang 0.5.23 parsed megarl's colocated argv as meant, and sized the KV cache as
    `megarl plan` assumes (docs/planning.md): mem_fraction_static x the memory free at start-up
    - the weights. The server measures free memory after its own CUDA context exists (under
    1 GiB here, so 0.3 GiB of the fraction) and rounds the pool to pages: within 5%."""
    info = httpx.get(server.process.url + "/server_info", headers=bearer(KEY), timeout=30).json()
    assert (info["mem_fraction_static"], info["enable_memory_saver"], info["tp_size"], info["random_seed"],
            info["dtype"]) == (MEM_FRACTION, True, 1, 7, "bfloat16")
    want = MEM_FRACTION * server.free_at_start - server.weight_bytes
    got = info["max_total_num_tokens"] * KV_BYTES_PER_TOKEN
    assert abs(got - want) < 0.05 * want, (got, want)


def test_the_server_requires_its_key_on_control_routes(server):
    """SGLang started as the fleet starts it (its key from the environment through
    megarl.rollout.with_api_key): the control routes refuse a request without the key or with
    another (401, SGLang 0.5.23's middleware), the health checks answer, and the key is not on
    the server's command line."""
    url = server.process.url
    for route in ("/pause_generation", "/update_weights_from_disk", "/release_memory_occupation",
                  "/init_weights_update_group", "/generate", "/server_info", "/flush_cache"):
        for headers in ({}, bearer(KEY + "x")):
            assert httpx.post(url + route, json={}, headers=headers, timeout=30).status_code == 401, route
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    with open(f"/proc/{server.process.pid()}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()


@path("sglang_flags")
def test_generate_by_token_ids_with_hf_log_probs(server):
    out = check_log_probs(server.client, server.model)
    assert len(out.token_ids) == 16 and out.finish_reason == "length"


def test_weights_from_disk(server, tmp_path):
    client = server.client
    new = small_model(server.vocab, seed=1)
    client.weight_dir = str(tmp_path)
    asyncio.run(client.begin_weight_update())
    asyncio.run(client.update_weights(group_tensors(hf_tensors(new), 8 << 20), version=1))
    asyncio.run(client.end_weight_update())
    assert check_log_probs(client, new).weight_version == 1


@path("nccl_sync")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL puts each rank on its own GPU: needs two GPUs")
def test_weights_over_an_nccl_group(server):
    """The nccl transport's rank side (GroupSender) and its join body, buckets of two dtypes."""
    from megarl.weights.group import GroupSender, init_group_body

    client = server.client
    new = small_model(server.vocab, seed=2).cuda(0)
    port = free_port()
    sender = GroupSender("nccl", "127.0.0.1", port, 2, "megarl-test", [client.base_url], KEY)
    opened = threading.Thread(target=sender.open)  # returns once the engine has joined
    opened.start()
    asyncio.run(client.post("/init_weights_update_group", init_group_body("127.0.0.1", port, 1, 2, "megarl-test",
                                                                            "nccl")))
    opened.join()
    asyncio.run(client.begin_weight_update())  # SGLang loads from a group only inside a weight-update session
    assert sender.send(group_tensors(two_dtypes(new), 8 << 20), version=2) >= 2
    asyncio.run(client.end_weight_update())
    assert check_log_probs(client, new.cpu()).weight_version == 2
    sender.close()


@path("ipc_sync")
def test_weights_through_cuda_ipc(server):
    """The ipc transport's rank side (IpcSender) for one train rank on the engine's GPU, with
    SGLang's own handle serializer; buckets of two dtypes."""
    from megarl.weights.ipc import IpcSender
    from megarl.weights.transport import RankPlace

    client = server.client
    with torch.cuda.device(server.gpu):
        new = small_model(server.vocab, seed=3).cuda(server.gpu)
        place = RankPlace(rank=0, node="127.0.0.1", gpu=str(server.gpu), stage=0, is_source=True)
        sender = IpcSender([place], 0, [(client.base_url, [0])], makes_handle=True, api_key=KEY)
        sender.open()
        asyncio.run(client.begin_weight_update())  # and tensors too
        assert sender.send(group_tensors(two_dtypes(new), 8 << 20), version=3) >= 2
        asyncio.run(client.end_weight_update())
        sender.close()
    assert check_log_probs(client, new.cpu()).weight_version == 3


@path("memory_release")
def test_fleet_releases_and_resumes_memory_around_weight_updates(server, tmp_path):
    """Two training steps as the colocated fleet runs them (SGLangFleet): release the engine's
    memory for the trainer, take the weights' back, update them, take the rest back (KV cache
    and CUDA graphs) and decode: each release frees at least the KV cache (0.3 x the memory
    free at start-up, less the weights: over 0.25 x), each resume takes it all back (within
    1 GiB), and greedy decoding (CUDA graphs replayed) gives the new weights' log-probs."""
    from megarl.config import SGLangConfig
    from megarl.rollout.sglang import SGLangFleet

    fleet = SGLangFleet([("engine0", InThisProcess(server.process), server.process.url, 1, "127.0.0.1",
                          (str(server.gpu),))], SGLangConfig(router=False), weight_dir=str(tmp_path), api_key=KEY)
    for version in (4, 5):
        new = small_model(server.vocab, seed=version)
        before = free_memory(server.gpu)
        asyncio.run(fleet.release_memory())
        released = free_memory(server.gpu)
        assert released - before > 0.25 * server.free_at_start, (released - before, server.free_at_start)
        asyncio.run(fleet.begin_weight_update())
        asyncio.run(fleet.update_weights(group_tensors(hf_tensors(new), 8 << 20), version))
        asyncio.run(fleet.end_weight_update())
        assert abs(free_memory(server.gpu) - before) < 1 << 30
        out = check_log_probs(fleet.servers[0].client, new)
        assert out.weight_version == version
    asyncio.run(fleet.close())


@path("partial_rollouts")
def test_partial_rollouts_abort_and_keep(server, tmp_path):
    """The two ways a weight sync meets a generation in flight (trainer.async_rollout), in the
    fleet's order (SGLangFleet): abort (`/abort_request` with abort_all ends the running request
    with its tokens, marked as megarl's own; its continuation waits in the fleet until the sync
    is over, then the agent loop joins the parts to the full length) and keep (a pause in
    retract mode, new weights, then continue: the generation goes on, and SGLang's
    `meta_info.weight_versions` spans give each token's version, the old weights' first).
    Nothing is sent to a paused server: SGLang holds such a request where abort_all does not
    reach it (tests/sglang_real runs the same on SGLang's CPU engine)."""
    from megarl.config import SGLangConfig
    from megarl.rollout.agent import Trajectory, generate_continued
    from megarl.rollout.sglang import SGLangFleet

    fleet = SGLangFleet([("engine0", InThisProcess(server.process), server.process.url, 1, "127.0.0.1",
                          (str(server.gpu),))], SGLangConfig(router=False), weight_dir=str(tmp_path), api_key=KEY)
    old = asyncio.run(fleet.generate(PROMPT, SamplingParams(max_new_tokens=1, temperature=0.0))).weight_version

    async def across_a_sync(abort: bool, version: int):
        traj = Trajectory(prompt_ids=PROMPT)
        params = SamplingParams(max_new_tokens=1500, temperature=0.0, ignore_eos=True)
        task = asyncio.ensure_future(generate_continued(fleet, None, PROMPT, params, traj))
        await asyncio.sleep(0.5)  # some tokens from the old weights
        if abort:
            await fleet.abort_requests()
        await fleet.begin_weight_update()
        await fleet.update_weights(group_tensors(hf_tensors(small_model(server.vocab, seed=version)), 8 << 20),
                                   version)
        await fleet.end_weight_update()
        return await task, traj

    for abort, version in ((True, old + 1), (False, old + 2)):
        out, traj = asyncio.run(across_a_sync(abort, version))
        versions = out.versions()
        assert traj.num_continued == int(abort) and len(out.token_ids) == 1500
        assert versions[0] == version - 1 and versions[-1] == version and versions == sorted(versions)
    asyncio.run(fleet.close())
