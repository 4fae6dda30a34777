"""SGLang 0.5.23's own server on the CPU, started as the fleet starts an engine (`server_command`
with the CPU setting, `ServerProcess`, the run's key), against every route and field megarl
sends or reads: generation by token ids with HF's log-probs, the key, the weight updates by each
transport that runs on the CPU (disk; the nccl transport's process group over gloo; the ipc
transport's tensors with torch's `file_system` sharing standing in for CUDA IPC), each inside
SGLang's weight-update session, and the served model checked against the trained one after each;
pause, abort and continue as the partial rollouts use them.

The model is float32 on both sides: SGLang's torch-native CPU attention and HF's agree within
1e-4 on its log-probs (measured: under 1e-5), far below the margin between the top tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from megarl.http_auth import bearer
from megarl.rollout import sglang_api
from megarl.rollout.engine import SamplingParams
from megarl.rollout.http import HTTPEngine
from megarl.rollout.sglang_launch import CPU_SERVER_ENV, ServerProcess, free_port, server_command
from megarl.weights.buckets import group_tensors, hf_tensors
from in_this_process import InThisProcess
from tiny_models import reference_log_probs, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.sglang
KEY = "sglang-cpu-test-key"
PROMPT = [5, 6, 7, 8, 9, 10, 11]
TOLERANCE = 1e-4
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def model_with(vocab_size: int, seed: int):
    return tiny_model("qwen2", vocab_size=vocab_size, seed=seed, eos_token_id=None)


def saved_model(root: Path, sglang_env: str, *overrides: str):
    """(the tiny model of seed 0, its vocabulary size, the run config of a CPU server of it) with
    the model and tokenizer saved in root/model."""
    from megarl.config import load_config

    tok = tiny_tokenizer()
    model = model_with(len(tok), seed=0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    cfg = load_config(None, [f"model.path={root / 'model'}", "model.dtype=float32", "rollout.engine=sglang",
                             "cluster.launcher=ray", "cluster.gpus_per_node=0", f"rollout.sglang.python={sglang_env}",
                             "rollout.sglang.max_total_tokens=8192", "rollout.max_concurrency=16", "trainer.seed=7",
                             *overrides])
    return model, len(tok), cfg


def cpu_server(root: Path, sglang_env: str):
    """A CPU server of the tiny model of seed 0 (saved in root/model), started as the fleet starts
    one, with a client; stopped when the generator closes (a module fixture's body)."""
    model, vocab, cfg = saved_model(root, sglang_env)
    process = ServerProcess(server_command(cfg, colocated=False), "sglang0", log_dir=str(root), api_key=KEY,
                            env=dict(CPU_SERVER_ENV))
    process.start(timeout_s=300)
    client = HTTPEngine(process.url, api_key=KEY, weight_dir=str(root))
    yield SimpleNamespace(process=process, client=client, model=model, vocab=vocab, root=root)
    process.stop()


async def generated(url: str, tokens: int, deadline_s: float = 300.0) -> None:
    """Return once the server's running request holds at least `tokens` generated tokens (SGLang's
    /v1/loads: the KV tokens in use, the prompt's included; refreshed every few decode steps):
    progress polled, not guessed from a time."""
    async with httpx.AsyncClient(base_url=url, headers=bearer(KEY), timeout=30) as client:
        deadline = time.monotonic() + deadline_s
        while True:
            (load,) = (await client.get("/v1/loads")).json()["loads"]
            if load["num_running_reqs"] and load["num_used_tokens"] >= len(PROMPT) + tokens:
                return
            assert time.monotonic() < deadline, f"{tokens} tokens not generated in {deadline_s:.0f} s: {load}"
            await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory, sglang_env):
    yield from cpu_server(tmp_path_factory.mktemp("sglang"), sglang_env)


def served_is(client: HTTPEngine, model, version: int | None = None):
    """Greedy tokens of the server are HF's, with HF's log-probs: the server holds `model`."""
    out = asyncio.run(client.generate(PROMPT, GREEDY))
    with torch.no_grad():
        hf = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=GREEDY.max_new_tokens,
                            min_new_tokens=GREEDY.max_new_tokens)[0, len(PROMPT):].tolist()
    assert out.token_ids == hf
    torch.testing.assert_close(torch.tensor(out.log_probs), reference_log_probs(model, PROMPT, out.token_ids),
                               atol=TOLERANCE, rtol=0)
    if version is not None:
        assert out.weight_version == version
    return out


def test_sglang_serves_token_ids_with_hfs_log_probs(server):
    out = served_is(server.client, server.model)
    assert out.finish_reason == "length" and out.prompt_tokens == len(PROMPT)


def test_the_cpu_server_runs_as_the_fleet_configured_it(server):
    info = httpx.get(server.process.url + "/server_info", headers=bearer(KEY), timeout=30).json()
    assert (info["device"], info["attention_backend"], info["max_total_num_tokens"], info["random_seed"],
            info["dtype"], info["sleep_on_idle"]) == ("cpu", "torch_native", 8192, 7, "float32", True)
    assert info["version"] == sglang_api.SGLANG_VERSION
    model_info = httpx.get(server.process.url + "/get_model_info", headers=bearer(KEY), timeout=30).json()
    assert model_info["model_path"] == str(server.root / "model") and model_info["is_generation"]


def test_the_server_requires_the_runs_key_on_every_route_but_health(server):
    url = server.process.url
    for route in ("/pause_generation", "/update_weights_from_disk", "/begin_weight_update",
                  "/init_weights_update_group", "/generate", "/abort_request", "/flush_cache"):
        for headers in ({}, bearer(KEY + "x")):
            assert httpx.post(url + route, json={}, headers=headers, timeout=30).status_code == 401, route
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert KEY.encode() not in Path(f"/proc/{server.process.pid()}/cmdline").read_bytes()


def test_weights_from_disk(server):
    new = model_with(server.vocab, seed=1)
    client = server.client
    asyncio.run(client.begin_weight_update())
    asyncio.run(client.update_weights(group_tensors(hf_tensors(new), 40_000), version=1))
    asyncio.run(client.end_weight_update())
    served_is(client, new, version=1)


def test_a_lora_actors_merged_weights_are_served_as_peft_merges_them(server):
    """actor.lora's sync: the torch backend's PEFT model (B trained off zero) sends base + scale B A
    under the HF names; SGLang then serves PEFT's own merge of the same adapters, HF's tokens and
    log-probs."""
    import copy

    from megarl.backends.torch.worker import TorchTrainWorker
    from megarl.config import load_config

    cfg = load_config(None, ["actor.lora.r=4", "actor.lora.lora_alpha=8", "actor.lora.target_modules=[all-linear]"])
    worker = TorchTrainWorker(model_with(server.vocab, seed=0), cfg, total_steps=1)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in worker.actor.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    merged = copy.deepcopy(worker.actor.model).merge_and_unload().eval()
    client = server.client
    asyncio.run(client.begin_weight_update())
    asyncio.run(client.update_weights(worker.export_hf_weights(40_000), version=5))
    asyncio.run(client.end_weight_update())
    out = served_is(client, merged, version=5)
    base = reference_log_probs(model_with(server.vocab, seed=0), PROMPT, out.token_ids)
    assert not torch.allclose(torch.tensor(out.log_probs), base, atol=1e-3)  # the adapters are in what it serves


def open_group(client: HTTPEngine, name: str, timeout_s: float):
    """The nccl transport's sender, over gloo, joined by the server as rank 1."""
    from megarl.weights.group import GroupSender, init_group_body

    port = free_port()
    sender = GroupSender("gloo", "127.0.0.1", port, 2, name, [client.base_url], KEY, timeout_s=timeout_s)
    opened = threading.Thread(target=sender.open)
    opened.start()
    asyncio.run(client.post("/init_weights_update_group", init_group_body("127.0.0.1", port, 1, 2, name, "gloo")))
    opened.join()
    return sender


def test_weights_over_a_gloo_update_group_inside_the_session(server):
    """The nccl transport's code on gloo: buckets of two dtypes, one flattened bucket each."""
    from megarl.weights.group import destroy_group_body

    client = server.client
    new = model_with(server.vocab, seed=2)
    tensors = [(n, t.double() if "norm" in n else t) for n, t in hf_tensors(new)]  # fp64 norms: a second dtype
    sender = open_group(client, "megarl-test", timeout_s=120)
    asyncio.run(client.begin_weight_update())
    assert sender.send(group_tensors(tensors, 40_000), version=2) >= 3
    asyncio.run(client.end_weight_update())
    served_is(client, new, version=2)
    sender.close()
    asyncio.run(client.post("/destroy_weights_update_group", destroy_group_body("megarl-test")))


def test_sglang_refuses_a_group_update_outside_the_session(server):
    """What megarl did before it opened the session: SGLang answers 400 without joining the
    broadcast, and the sender's error carries that answer."""
    from megarl.weights.group import destroy_group_body

    client = server.client
    sender = open_group(client, "megarl-refused", timeout_s=5)
    asyncio.run(client.pause())
    with pytest.raises(RuntimeError, match="update_weights_from_distributed must run between begin_weight_update"):
        sender.send([{"lm_head.weight": dict(hf_tensors(server.model))["lm_head.weight"]}], version=3)
    asyncio.run(client.resume())
    sender.close()
    asyncio.run(client.post("/destroy_weights_update_group", destroy_group_body("megarl-refused")))


def test_weights_as_tensors_through_file_system_sharing(server, sglang_env):
    """The ipc transport's sender (IpcSender with SGLang's own serializer) in a process of the
    SGLang environment, with torch's file_system sharing in place of CUDA IPC handles."""
    new = model_with(server.vocab, seed=4)
    weights = server.root / "seed4.safetensors"
    from safetensors.torch import save_file

    save_file(dict(hf_tensors(new)), str(weights))
    client = server.client
    asyncio.run(client.begin_weight_update())
    output = server.root / "tensor_sender.out"
    with open(output, "w") as out:  # a file, not a pipe: torch's shared-memory manager outlives the sender
        code = subprocess.run([sglang_env, str(Path(__file__).with_name("tensor_sender.py")), client.base_url,
                               str(weights), "4"], env={**os.environ, "MEGARL_ENGINE_API_KEY": KEY},
                              stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode
    asyncio.run(client.end_weight_update())
    lines = output.read_text().splitlines()
    assert code == 0, "\n".join(lines[-40:])
    assert json.loads(lines[-1])["buckets"] >= 2
    served_is(client, new, version=4)


def test_control_routes_answer_as_megarl_reads_them(server):
    client = server.client

    async def go():
        await client.flush_cache()
        await client.release_memory()  # on the CPU: accepted, and nothing is freed
        await client.resume_memory()
        healthy = await client.health()
        await client.post("/abort_request", sglang_api.abort_all_body())
        return healthy

    assert asyncio.run(go())


def one_engine_fleet(server):
    from megarl.config import SGLangConfig
    from megarl.rollout.sglang import SGLangFleet

    return SGLangFleet([("engine0", InThisProcess(server.process), server.process.url, 1)], SGLangConfig(router=False),
                       weight_dir=str(server.root), api_key=KEY)


def log_probs_under(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    return reference_log_probs(model, prompt, tokens)


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_a_generation_across_a_weight_sync(server, mode):
    """The two ways a sync meets a generation in flight (trainer.async_rollout.partial_rollouts),
    in the fleet's order: abort (its tokens so far come back, its continuation waits until the
    sync is over and runs on the new weights: the agent loop joins the parts) and keep (SGLang's
    pause retracts it, it goes on after the update). Every token carries the version of the
    weights that sampled it, and its log-prob is that model's."""
    from megarl.rollout.agent import Trajectory, generate_continued

    fleet = one_engine_fleet(server)
    old_version = asyncio.run(fleet.generate(PROMPT, GREEDY)).weight_version
    old = model_with(server.vocab, seed=10 + old_version)
    asyncio.run(fleet.begin_weight_update())  # a known model to start from
    asyncio.run(fleet.update_weights(group_tensors(hf_tensors(old), 40_000), old_version))
    asyncio.run(fleet.end_weight_update())
    new, version = model_with(server.vocab, seed=20 + old_version), old_version + 1
    params = SamplingParams(max_new_tokens=800, temperature=0.0, ignore_eos=True)

    parts, generate = [], fleet.generate

    async def recorded(prompt_ids, p):
        parts.append(await generate(prompt_ids, p))
        return parts[-1]

    fleet.generate = recorded

    async def across_a_sync():
        traj = Trajectory(prompt_ids=PROMPT)
        task = asyncio.ensure_future(generate_continued(fleet, None, PROMPT, params, traj))
        await generated(server.process.url, params.max_new_tokens // 4)  # a quarter on the old weights at least
        if mode == "abort":
            await fleet.abort_requests()
        await fleet.begin_weight_update()
        await fleet.update_weights(group_tensors(hf_tensors(new), 40_000), version)
        await fleet.end_weight_update()
        return await task, traj

    out, traj = asyncio.run(across_a_sync())
    asyncio.run(fleet.close())
    versions = out.versions()
    assert len(out.token_ids) == params.max_new_tokens and out.finish_reason == "length"
    assert traj.num_continued == (1 if mode == "abort" else 0)
    switch = versions.index(version)
    assert 0 < switch and versions == [old_version] * switch + [version] * (len(versions) - switch)
    if mode == "abort":  # the continuation waited for the sync: none of it ran on the old weights
        assert [len(p.token_ids) for p in parts] == [switch, len(versions) - switch]
    before, after = out.token_ids[:switch], out.token_ids[switch:]
    torch.testing.assert_close(torch.tensor(out.log_probs[:switch]), log_probs_under(old, PROMPT, before),
                               atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(torch.tensor(out.log_probs[switch:]), log_probs_under(new, PROMPT + before, after),
                               atol=TOLERANCE, rtol=0)


def test_sglang_refuses_to_flush_its_cache_under_running_requests(server):
    """Why megarl flushes only while the engines are paused (end_weight_update): SGLang answers
    400 to /flush_cache while a request runs, and flushes once it is paused (retracted)."""
    client = server.client

    async def go():
        task = asyncio.ensure_future(client.generate(PROMPT, SamplingParams(max_new_tokens=800, temperature=0.0,
                                                                            ignore_eos=True)))
        await generated(server.process.url, 1)
        assert not task.done()
        with pytest.raises(RuntimeError, match="/flush_cache answered 400"):
            await client.flush_cache()
        await client.pause()
        await client.flush_cache()
        await client.resume()
        return await task

    assert len(asyncio.run(go()).token_ids) == 800
