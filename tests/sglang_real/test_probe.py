"""The weights probe (megarl.weights.probe) against SGLang 0.5.23's own CPU server: its prompt
log-probs (/generate with logprob_start_len 0) are HF's, at the sampling temperature, and a
server whose weights were changed behind the run's back is told apart from one that holds them."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megarl.rollout import sglang_api
from megarl.weights.buckets import group_tensors, hf_tensors
from megarl.weights.probe import WeightProbe
from test_server import cpu_server, model_with
from tiny_models import reference_log_probs

pytestmark = pytest.mark.sglang
SEQUENCES = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 3, 77, 12, 9]]


@pytest.fixture(scope="module")
def server(tmp_path_factory, sglang_env):  # a server of its own: test_server.py's changes its weights
    yield from cpu_server(tmp_path_factory.mktemp("sglang-probe"), sglang_env)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_sglangs_prompt_log_probs_are_hfs_from_the_raw_logits_whatever_the_temperature(server, temperature):
    # why the probe scores at temperature 1 on both sides: SGLang 0.5.23 scales the sampled tokens'
    # log-probs by the request's temperature, never the prompt's (at 0.6 they would differ by ~0.17)
    async def scored():
        body = sglang_api.prompt_log_probs_body(sequence) | {"sampling_params": {"max_new_tokens": 1,
                                                                                   "temperature": temperature}}
        answer = await server.client.post("/generate", body)
        return sglang_api.prompt_log_probs_from_sglang(answer, len(sequence))

    for sequence in SEQUENCES:
        want = reference_log_probs(server.model, sequence[:1], sequence[1:])
        torch.testing.assert_close(torch.tensor(asyncio.run(scored())), want, rtol=0, atol=1e-4)
    got = asyncio.run(server.client.probe_log_probs(SEQUENCES))[server.client.base_url]
    for sequence, log_probs in zip(SEQUENCES, got):
        torch.testing.assert_close(torch.tensor(log_probs), reference_log_probs(server.model, sequence[:1], sequence[1:]),
                                   rtol=0, atol=1e-4)


def test_the_probe_tells_the_trainers_weights_from_others(server):
    probe = WeightProbe(SEQUENCES, tolerance=1e-4)
    probe.expected = [reference_log_probs(server.model, s[:1], s[1:]) for s in SEQUENCES]  # the trainer's
    assert asyncio.run(probe.mismatches(server.client)) == []
    other = model_with(server.vocab, seed=3)
    with torch.no_grad():  # one layer's MLP changed behind the run's back
        other.load_state_dict(server.model.state_dict())
        other.model.layers[1].mlp.down_proj.weight.mul_(1.5)

    def load(model, version):
        asyncio.run(server.client.begin_weight_update())
        asyncio.run(server.client.update_weights(group_tensors(hf_tensors(model), 40_000), version=version))
        asyncio.run(server.client.end_weight_update())

    load(other, 1)
    try:
        (mismatch,) = asyncio.run(probe.mismatches(server.client))
        assert mismatch.engine == server.client.base_url and mismatch.mean_abs > 10 * probe.tolerance
    finally:
        load(server.model, 2)
    assert asyncio.run(probe.mismatches(server.client)) == []
