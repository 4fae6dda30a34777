"""actor.lora.sync=adapter (the lora transport, megarl.weights.adapters) without SGLang: the
config's rules, the servers' LoRA flags, the adapter directory the ranks' files become (loaded
by PEFT onto the base, it gives the trainer's log-probs), and what the engine client sends.
SGLang's own server serving it: tests/sglang_real/test_lora_adapters.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from safetensors.torch import save_file

from megarl.config import ConfigError, load_config
from megarl.rollout.engine import SamplingParams
from megarl.rollout.http import HTTPEngine
from megarl.rollout.sglang_launch import server_command
from megarl.weights.adapters import write_adapter_dir
from megarl.weights.disk import DiskSender, version_dir
from test_lora_torch import LORA, lora_worker, randomise_b
from tiny_models import reference_log_probs, tiny_model

SERVERS = ["model.path=m", "rollout.engine=sglang", "cluster.launcher=ray", "cluster.gpus_per_node=0"]
ADAPTER = ["actor.lora.r=4", "actor.lora.sync=adapter"]


def problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(None, list(overrides))
    return str(error.value)


def test_adapter_sync_goes_through_the_lora_transport_to_sglangs_own_servers_only():
    assert load_config(None, SERVERS + ADAPTER).sync_transport() == "lora"
    assert load_config(None, SERVERS + ["actor.lora.r=4"]).sync_transport() == "nccl"  # merged: as without LoRA
    assert "actor.lora.sync: adapter needs engine servers that serve LoRA (rollout.engine=sglang)" in problems(
        "actor.lora.r=4", "actor.lora.sync=adapter")
    assert "sync.transport: disk moves whole weights, and actor.lora.sync=adapter sends the adapters alone" in problems(
        *SERVERS, *ADAPTER, "sync.transport=disk")
    assert "actor.lora.sync: adapter needs SGLang's own servers (LoRA serving)" in problems(
        *SERVERS, *ADAPTER, "rollout.sglang.server=embedded")
    assert "sync.transport: lora sends the LoRA adapters alone, and this run trains none" in problems(
        *SERVERS, "actor.lora.r=4", "sync.transport=lora")


def test_generations_kept_across_an_adapter_sync_are_refused():
    """partial_rollouts=keep leaves the generations running at a sync inside SGLang, on the adapter
    they started with: its unload in the sync waits for them (rollout.sglang.request_timeout_s, a
    sync), and their tokens after it would be labelled with the new adapter's version. Refused, with
    the two ways out; wait and abort leave no request on the old adapter, merged weights no adapter."""
    run_async = ["trainer.async_rollout.enable=true", "algorithm.tis_cap=2.0"]
    keep = "trainer.async_rollout.partial_rollouts=keep"
    with pytest.raises(ConfigError) as error:
        load_config(None, SERVERS + ADAPTER + run_async + [keep])
    (problem,) = error.value.problems
    assert problem.key == "trainer.async_rollout.partial_rollouts"
    assert "actor.lora.sync=adapter" in problem.what and "request_timeout_s" in problem.what
    assert "partial_rollouts=abort" in problem.fix and "actor.lora.sync=merged" in problem.fix
    for fine in (["trainer.async_rollout.partial_rollouts=abort"], ["trainer.async_rollout.partial_rollouts=wait"],
                 [keep, "actor.lora.sync=merged"], [keep, "trainer.async_rollout.enable=false"]):
        load_config(None, SERVERS + ADAPTER + run_async + fine)


def test_the_servers_start_with_lora_serving_for_the_runs_rank_and_modules():
    argv = server_command(load_config(None, SERVERS + ADAPTER + ["actor.lora.target_modules=[q_proj,down_proj]"]),
                          colocated=False)
    at = argv.index("--enable-lora")
    assert argv[at:] == ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "q_proj", "down_proj",
                         "--max-loaded-loras", "2", "--max-loras-per-batch", "2", "--lora-backend", "torch_native"]
    gpu = server_command(load_config(None, SERVERS[:-1] + ADAPTER + ["cluster.gpus_per_node=8"]), colocated=True)
    assert "--enable-lora" in gpu and "--lora-backend" not in gpu  # SGLang's own kernel on a GPU
    assert "--enable-lora" not in server_command(load_config(None, SERVERS + ["actor.lora.r=4"]), colocated=False)


def test_the_ranks_adapter_files_become_a_peft_directory_with_the_trainers_log_probs(tmp_path):
    from peft import PeftModel

    worker, _ = lora_worker(["actor.lora.sync=adapter", "rollout.engine=sglang", "cluster.launcher=ray"])
    randomise_b(worker)
    sent = dict(worker._hf_tensors())
    assert sent and all(".lora_A." in n or ".lora_B." in n for n in sent)  # the adapters alone, not the base
    names = sorted(sent)  # two source ranks (pipeline stages), each with part of the adapters
    DiskSender(str(tmp_path), 0).send([{n: sent[n] for n in names[:4]}], 5)
    DiskSender(str(tmp_path), 2).send([{n: sent[n] for n in names[4:]}], 5)
    directory = write_adapter_dir(version_dir(tmp_path, 5), worker.cfg.actor.lora, "the/base")
    assert sorted(p.name for p in directory.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((directory / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, "the/base")
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    served = PeftModel.from_pretrained(tiny_model("qwen2", seed=0), str(directory)).eval()
    ids = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    trainer = reference_log_probs(worker.actor.model.eval(), ids[:4], ids[4:])
    assert torch.allclose(reference_log_probs(served, ids[:4], ids[4:]), trainer, atol=1e-5)
    base = reference_log_probs(tiny_model("qwen2", seed=0), ids[:4], ids[4:])
    assert not torch.allclose(base, trainer, atol=1e-3)  # the adapters change what is served


def test_an_adapter_directory_with_a_name_twice_or_no_adapter_is_refused(tmp_path):
    lora = load_config(None, LORA).actor.lora
    twice = tmp_path / "twice"
    twice.mkdir()
    for rank in (0, 1):
        save_file({"base_model.model.x.lora_A.weight": torch.ones(2, 2)}, str(twice / f"rank{rank:05d}-00000.safetensors"))
    with pytest.raises(ValueError, match="rank00001-00000.safetensors holds base_model.model.x.lora_A.weight, which "
                                         "another rank's file holds too"):
        write_adapter_dir(twice, lora, "b")
    merged = tmp_path / "merged"
    merged.mkdir()
    save_file({"model.embed_tokens.weight": torch.ones(2, 2)}, str(merged / "rank00000-00000.safetensors"))
    with pytest.raises(ValueError, match=r"no LoRA adapter tensors .* the ranks sent \['model.embed_tokens.weight'\]"):
        write_adapter_dir(merged, lora, "b")


def test_the_client_serves_every_request_with_the_newest_adapter_and_unloads_the_one_before():
    seen, loaded = [], set()

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if request.url.path == "/generate":
            return httpx.Response(200, json={"output_ids": [4], "meta_info": {
                "output_token_logprobs": [[-0.5, 4, None]], "finish_reason": {"type": "length"},
                "input_token_logprobs": [[None, 1, None], [-1.0, 2, None]], "weight_version": "3",
                "prompt_tokens": 2}})
        if body.get("lora_name") == "megarl-v000004" and request.url.path == "/unload_lora_adapter" and \
                seen.count(seen[-1]) > 1:  # unloaded once to be loaded afresh; gone at the second
            return httpx.Response(400, json={"success": False, "message": "not loaded"})
        if request.url.path == "/load_lora_adapter" and body["lora_name"] in loaded:  # SGLang's answer
            return httpx.Response(400, json={"success": False, "error_message": f"Failed to load LoRA adapter "
                                             f"{body['lora_name']} because it is already loaded"})
        if request.url.path == "/load_lora_adapter":
            loaded.add(body["lora_name"])
        if request.url.path == "/unload_lora_adapter":
            loaded.discard(body["lora_name"])
        return httpx.Response(200, json={"success": True})

    async def go():
        client = HTTPEngine("http://engine", transport=httpx.MockTransport(handler))
        await client.generate([1, 2], SamplingParams(max_new_tokens=1))
        await client.load_adapter("/w/v000003", 3)
        await client.generate([1, 2], SamplingParams(max_new_tokens=1))
        await client.prompt_log_probs([1, 2])
        await client.load_adapter("/w/v000004", 4)
        await client.load_adapter("/w/v000004", 4)  # the same version again (a reload): loaded afresh
        await client.load_adapter("/w/v000005", 5)  # v4's unload fails: logged, v5 still served
        await client.generate([1, 2], SamplingParams(max_new_tokens=1))
        return client.adapter

    assert asyncio.run(go()) == "megarl-v000005"
    assert [(path, body.get("lora_name", body.get("lora_path", body.get("new_version")))) for path, body in seen] == [
        ("/generate", None),
        ("/load_lora_adapter", "megarl-v000003"), ("/update_weight_version", "3"),
        ("/generate", "megarl-v000003"), ("/generate", "megarl-v000003"),
        ("/load_lora_adapter", "megarl-v000004"), ("/update_weight_version", "4"),
        ("/unload_lora_adapter", "megarl-v000003"),
        ("/load_lora_adapter", "megarl-v000004"), ("/unload_lora_adapter", "megarl-v000004"),
        ("/load_lora_adapter", "megarl-v000004"), ("/update_weight_version", "4"),
        ("/load_lora_adapter", "megarl-v000005"), ("/update_weight_version", "5"),
        ("/unload_lora_adapter", "megarl-v000004"),
        ("/generate", "megarl-v000005")]
    assert seen[1][1] == {"lora_name": "megarl-v000003", "lora_path": "/w/v000003"}


def test_megarls_embedded_server_refuses_an_adapter_by_name():
    from fastapi.testclient import TestClient

    from megarl.rollout.http import create_engine_app
    from megarl.rollout.local import LocalEngine
    from tiny_models import tiny_tokenizer

    tok = tiny_tokenizer()
    app = create_engine_app(LocalEngine(tiny_model("qwen2", vocab_size=len(tok)), tok, eos_token_ids=[]), tok)
    answer = TestClient(app).post("/load_lora_adapter", json={"lora_name": "megarl-v000001", "lora_path": "/w"})
    assert answer.status_code == 400 and answer.json() == {
        "success": False, "message": "megarl's embedded engine serves merged weights, not LoRA adapters: use "
                                     "actor.lora.sync=merged"}
