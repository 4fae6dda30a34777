"""SGLang 0.5.23's CPU server serving the real pretrained model (SmolLM2-135M-Instruct, a Llama
with tied embeddings: tests/real_model.py), started as the fleet starts an engine: HF's greedy
tokens, the weights probe's noise floor between SGLang and the trainer's plain forward on the
real weights, and a weight sync that the probe sees arrive and leave."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from megarl.config import load_config
from megarl.rollout.engine import SamplingParams
from megarl.rollout.http import HTTPEngine
from megarl.rollout.sglang_launch import CPU_SERVER_ENV, ServerProcess, server_command
from megarl.weights.buckets import group_tensors, hf_tensors
from megarl.weights.probe import WeightProbe
from real_model import real_model_dir
from tiny_models import reference_log_probs

pytestmark = pytest.mark.sglang
KEY = "sglang-real-model-key"
QUESTIONS = ["What is 17 + 25?", "Name the largest planet of the solar system.", "Write a haiku about rain."]


def chat_prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


@pytest.fixture(scope="module")
def server(tmp_path_factory, sglang_env):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("sglang-real")
    model_dir = real_model_dir()
    cfg = load_config(None, [f"model.path={model_dir}", "model.dtype=float32", "rollout.engine=sglang",
                             "cluster.launcher=ray", "cluster.gpus_per_node=0", f"rollout.sglang.python={sglang_env}",
                             "rollout.sglang.max_total_tokens=4096", "rollout.max_concurrency=8", "trainer.seed=7"])
    process = ServerProcess(server_command(cfg, colocated=False), "sglang0", log_dir=str(root), api_key=KEY,
                            env=dict(CPU_SERVER_ENV))
    process.start(timeout_s=300)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yield SimpleNamespace(client=HTTPEngine(process.url, api_key=KEY, weight_dir=str(root)), model=model,
                          prompts=chat_prompts(model_dir))
    process.stop()


def floor(client: HTTPEngine, model, sequences: list[list[int]]) -> float:
    """The probe's measure between the server and `model`: the mean absolute log-prob difference a
    token over `sequences` scored as prompts."""
    got = asyncio.run(client.probe_log_probs(sequences))[client.base_url]
    diffs = [(torch.tensor(lp) - reference_log_probs(model, s[:1], s[1:])).abs() for s, lp in zip(sequences, got)]
    return float(torch.cat(diffs).mean())


def test_sglang_serves_the_real_models_greedy_answers_with_hfs_log_probs(server):
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    server.model.generation_config.eos_token_id = None  # as ignore_eos: 16 tokens, an end-of-turn among them
    for prompt in server.prompts:
        out = asyncio.run(server.client.generate(prompt, greedy))
        with torch.no_grad():
            hf = server.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, pad_token_id=0)
        assert out.token_ids == hf[0, len(prompt):].tolist()
        torch.testing.assert_close(torch.tensor(out.log_probs), reference_log_probs(server.model, prompt, out.token_ids),
                                   atol=1e-4, rtol=0)


def test_the_probes_noise_floor_on_real_weights_and_a_sync_it_sees(server):
    sequences = [p + [13, 198] for p in server.prompts]
    measured = floor(server.client, server.model, sequences)
    print(f"\nSGLang 0.5.23 (CPU, float32) vs the trainer's forward, SmolLM2-135M: {measured:.2e} a token")
    # float32 on both sides, sums in another order: measured 1.35e-5 (the embedded engine's is the
    # same, tests/test_real_model_paths.py); the probe's float32 bound on the CPU is 1e-4
    assert measured < 1e-4 / 3
    probe = WeightProbe(sequences, tolerance=1e-4)
    probe.expected = [reference_log_probs(server.model, s[:1], s[1:]) for s in sequences]
    assert asyncio.run(probe.mismatches(server.client)) == []

    changed = {name: tensor.clone() for name, tensor in hf_tensors(server.model)}
    changed["model.layers.17.mlp.down_proj.weight"].mul_(1.05)  # one of 30 layers, 5%: a small change

    def load(tensors: dict, version: int):
        asyncio.run(server.client.begin_weight_update())
        asyncio.run(server.client.update_weights(group_tensors(iter(tensors.items()), 8 << 20), version=version))
        asyncio.run(server.client.end_weight_update())

    load(changed, 1)
    try:
        (mismatch,) = asyncio.run(probe.mismatches(server.client))
        assert mismatch.mean_abs > 10 * probe.tolerance
    finally:
        load(dict(hf_tensors(server.model)), 2)
    assert asyncio.run(probe.mismatches(server.client)) == []
