"""One real SGLang server on a GPU (skipped where CUDA or SGLang is missing): generation by
token ids with log-probs against HF's, then weight updates the three ways the fleet sends
them (disk, an NCCL update group, CUDA IPC handles with the memory released and resumed
around it), each checked by the log-probs of the new weights.

The NCCL case needs two GPUs (NCCL refuses two ranks on one device); disk and CUDA IPC run on one.
Tolerance (bf16, as tests/gpu/test_megatron_gpu.py explains): SGLang's kernels and HF's
agree within 0.15 at worst and 0.03 on average over the tokens of a greedy continuation.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading

import pytest
import torch

from megarl.rollout.engine import SamplingParams
from megarl.rollout.http import HTTPEngine
from megarl.rollout.sglang import ServerProcess, free_port
from megarl.weights.buckets import group_tensors, hf_tensors
from tiny_models import reference_log_probs, tiny_tokenizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang (pip install '.[gpu]')")]

PROMPT = [5, 6, 7, 8, 9]


def small_model(vocab_size: int, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, eos_token_id=None, torch_dtype="bfloat16")
    return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    tok = tiny_tokenizer()
    model = small_model(len(tok), seed=0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    process = ServerProcess([sys.executable, "-m", "sglang.launch_server", "--model-path", str(root / "model"),
                             "--dtype", "bfloat16", "--mem-fraction-static", "0.3", "--enable-memory-saver",
                             "--random-seed", "0"], "sglang0", log_dir=str(root),
                            # the last GPU (the trainer side of the tests uses cuda:0; NCCL needs two devices)
                            env={"CUDA_VISIBLE_DEVICES": str(torch.cuda.device_count() - 1)})
    process.start(timeout_s=900)
    yield process, HTTPEngine(process.url), model, len(tok)
    process.stop()


def check_log_probs(client, model):
    out = asyncio.run(client.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)))
    want = reference_log_probs(model.cuda(), PROMPT, out.token_ids).cpu()
    diff = (torch.tensor(out.log_probs) - want.float()).abs()
    assert float(diff.max()) < 0.15 and float(diff.mean()) < 0.03, (float(diff.max()), float(diff.mean()))
    model.cpu()
    return out


def test_generate_by_token_ids_with_hf_log_probs(server):
    _, client, model, _ = server
    out = check_log_probs(client, model)
    assert len(out.token_ids) == 16 and out.finish_reason == "length"


def test_weights_from_disk(server, tmp_path):
    _, client, _, vocab = server
    new = small_model(vocab, seed=1)
    client.weight_dir = str(tmp_path)
    asyncio.run(client.pause())
    asyncio.run(client.update_weights(group_tensors(hf_tensors(new), 8 << 20), version=1))
    asyncio.run(client.flush_cache())
    asyncio.run(client.resume())
    assert check_log_probs(client, new).weight_version == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL puts each rank on its own GPU: needs two GPUs")
def test_weights_over_an_nccl_group(server):
    from megarl.weights.group import DistributedSender, open_update_group

    _, client, _, vocab = server
    new = small_model(vocab, seed=2).cuda()
    port, joined = free_port(), {}
    trainer = threading.Thread(target=lambda: joined.setdefault(
        "group", open_update_group("nccl", "127.0.0.1", port, 0, 2, "megarl-test")))
    trainer.start()
    asyncio.run(client.post("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "megarl-test", "backend": "nccl"}))
    trainer.join()
    sender = DistributedSender(joined["group"], [client.base_url], "megarl-test")
    asyncio.run(client.pause())
    assert sender.send(group_tensors(hf_tensors(new), 8 << 20), version=2) >= 1
    asyncio.run(client.flush_cache())
    asyncio.run(client.resume())
    assert check_log_probs(client, new.cpu()).weight_version == 2
    sender.close()


def test_weights_through_cuda_ipc_with_memory_released(server):
    import httpx

    from megarl.weights.ipc import ipc_payload

    _, client, _, vocab = server
    new = small_model(vocab, seed=3).cuda()
    asyncio.run(client.release_memory())
    asyncio.run(client.resume_memory(["weights"]))
    asyncio.run(client.pause())
    for bucket in group_tensors(hf_tensors(new), 8 << 20):
        body, _buffer = ipc_payload(bucket, 1, 3)
        response = httpx.post(client.base_url + "/update_weights_from_tensor", json=body, timeout=300)
        assert response.status_code == 200 and response.json()["success"], response.text
    asyncio.run(client.flush_cache())
    asyncio.run(client.resume())
    asyncio.run(client.resume_memory(["kv_cache"]))
    assert check_log_probs(client, new.cpu()).weight_version == 3
