"""actor.lora.sync=adapter on SGLang 0.5.23's own CPU server (its LoRA serving, with
tools/sglang_cpu/unpinned standing in for pinned memory): the server started as the fleet starts
it for such a run, the torch backend's adapters sent through the lora transport's files, loaded
by `/load_lora_adapter` inside SGLang's weight-update session and served, to generation and to
the weights probe, as PEFT serves them; the next version replaces it. Then `megarl train` on the
quickstart with the adapters synced after every step and probed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from megarl.config import load_config
from megarl.http_auth import bearer
from megarl.rollout.engine import SamplingParams
from megarl.rollout.http import HTTPEngine
from megarl.rollout.sglang_launch import CPU_SERVER_ENV, ServerProcess, server_command
from megarl.weights.adapters import write_adapter_dir
from megarl.weights.disk import DiskSender, version_dir
from tiny_models import reference_log_probs, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.sglang
KEY = "sglang-lora-test-key"
PROMPT = [5, 6, 7, 8, 9, 10, 11]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
TOLERANCE = 1e-4  # SGLang's torch-native CPU attention against HF's, float32 (tests/sglang_real/test_server.py)
LORA = ["actor.lora.r=4", "actor.lora.lora_alpha=8", "actor.lora.target_modules=[all-linear]",
        "actor.lora.sync=adapter"]


def model_with(vocab_size: int):
    return tiny_model("qwen2", vocab_size=vocab_size, seed=0, eos_token_id=None)


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, sglang_env):
    root = tmp_path_factory.mktemp("sglang-lora")
    tok = tiny_tokenizer()
    model_with(len(tok)).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    cfg = load_config(None, [f"model.path={root / 'model'}", "model.dtype=float32", "rollout.engine=sglang",
                             "cluster.launcher=ray", "cluster.gpus_per_node=0", f"rollout.sglang.python={sglang_env}",
                             "rollout.sglang.max_total_tokens=8192", "rollout.max_concurrency=16",
                             f"trainer.output_dir={root / 'out'}", *LORA])
    process = ServerProcess(server_command(cfg, colocated=False), "sglang0", log_dir=str(root), api_key=KEY,
                            env=dict(CPU_SERVER_ENV))
    process.start(timeout_s=300)
    try:
        yield cfg, process, len(tok), root
    finally:
        process.stop()


def trained_worker(cfg, vocab: int, seed: int):
    """The torch backend's LoRA actor with B drawn by `seed` (as after some updates)."""
    from megarl.backends.torch.worker import TorchTrainWorker

    worker = TorchTrainWorker(model_with(vocab), cfg, total_steps=1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in worker.actor.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    worker.actor.model.eval()
    return worker


def sync(client: HTTPEngine, cfg, worker, root: Path, version: int) -> None:
    """What a sync of the lora transport does: the source rank's files, PEFT's directory, the load."""
    DiskSender(str(root / "sync"), 0).send(worker.export_hf_weights(40_000), version)
    directory = write_adapter_dir(version_dir(root / "sync", version), cfg.actor.lora, cfg.model.path)
    asyncio.run(client.begin_weight_update())
    asyncio.run(client.load_adapter(str(directory), version))
    asyncio.run(client.end_weight_update())


def served_as(client: HTTPEngine, model) -> list[int]:
    """The server's greedy tokens are `model`'s (a PEFT model), with its log-probs; the probe's
    log-probs of a sequence too. The tokens."""
    out = asyncio.run(client.generate(PROMPT, GREEDY))
    with torch.no_grad():
        hf = model.generate(input_ids=torch.tensor([PROMPT]), do_sample=False, max_new_tokens=GREEDY.max_new_tokens,
                            min_new_tokens=GREEDY.max_new_tokens)[0, len(PROMPT):].tolist()
    assert out.token_ids == hf
    torch.testing.assert_close(torch.tensor(out.log_probs), reference_log_probs(model, PROMPT, out.token_ids),
                               atol=TOLERANCE, rtol=0)
    probed = asyncio.run(client.prompt_log_probs(PROMPT + hf))
    torch.testing.assert_close(torch.tensor(probed), reference_log_probs(model, PROMPT[:1], PROMPT[1:] + hf),
                               atol=TOLERANCE, rtol=0)
    return out.token_ids


def loaded_adapters(url: str) -> list[str]:
    models = httpx.get(url + "/v1/models", headers=bearer(KEY), timeout=30).json()["data"]
    return sorted(m["id"] for m in models if m["id"].startswith("megarl-"))


def test_the_adapters_are_served_as_peft_serves_them_and_the_next_version_replaces_them(lora_server):
    cfg, process, vocab, root = lora_server
    client = HTTPEngine(process.url, api_key=KEY)
    base = asyncio.run(client.generate(PROMPT, GREEDY)).token_ids  # no adapter yet: the base
    first = trained_worker(cfg, vocab, seed=3)
    sync(client, cfg, first, root, 1)
    tokens = served_as(client, first.actor.model)
    assert asyncio.run(client.generate(PROMPT, GREEDY)).weight_version == 1  # the version the answers report
    assert tokens != base and loaded_adapters(process.url) == ["megarl-v000001"]
    second = trained_worker(cfg, vocab, seed=4)
    sync(client, cfg, second, root, 2)
    assert served_as(client, second.actor.model) != tokens
    assert loaded_adapters(process.url) == ["megarl-v000002"]  # the version before is unloaded
