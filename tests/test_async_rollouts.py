"""Asynchronous rollouts (trainer.async_rollout): staleness 0 is the synchronous run, staleness 1
trains on the previous weights, a resumed run keeps the data order, and a generation that a
weight sync preempts goes on from its tokens under the new weights (partial rollouts)."""

from __future__ import annotations

import asyncio
import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from megarl.algo.policy_loss import policy_loss
from megarl.config import ConfigError, load_config
from megarl.rollout.agent import Trajectory, generate_continued
from megarl.rollout.engine import PREEMPTED, GenerationOutput, SamplingParams
from megarl.rollout.local import LocalEngine
from megarl.rollout.sglang_api import token_versions, version_spans
from megarl.train import train
from tiny_models import reference_log_probs, tiny_model, tiny_tokenizer
from train_fixtures import mlflow_metric, tiny_overrides, write_tiny_run_inputs

ASYNC = ["trainer.async_rollout.enable=true", "algorithm.tis_cap=2.0"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("inputs"))


def test_staleness_zero_is_the_synchronous_run(inputs, tmp_path):
    sync, overlapped = tmp_path / "sync", tmp_path / "async0"
    train(load_config(None, tiny_overrides(inputs, sync, steps=3) + ["algorithm.tis_cap=2.0"]))
    train(load_config(None, tiny_overrides(inputs, overlapped, steps=3) + ASYNC +
                      ["trainer.async_rollout.max_staleness=0"]))
    a = load_file(str(sync / "checkpoints" / "step_000003" / "actor.safetensors"))
    b = load_file(str(overlapped / "checkpoints" / "step_000003" / "actor.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("train/reward_mean", "actor/pg_loss", "val/acc", "rollout/logprob_mismatch"):
        assert mlflow_metric(sync, name) == mlflow_metric(overlapped, name), name
    assert mlflow_metric(overlapped, "rollout/staleness_max") == [0, 0, 0]


def test_staleness_one_trains_on_the_previous_weights(inputs, tmp_path):
    """Batch 0 comes from the initial weights (version 0, trained at step 0); batch k >= 1 is
    generated while step k - 1 trains, from version k - 1, and trained at version k. With
    partial_rollouts=wait no token of it comes from a later version."""
    out = tmp_path / "async1"
    train(load_config(None, tiny_overrides(inputs, out, steps=3) + ASYNC))
    assert mlflow_metric(out, "rollout/staleness_max") == [0, 1, 1]
    assert mlflow_metric(out, "rollout/staleness_mean") == [0, 1, 1]
    assert mlflow_metric(out, "rollout/stale_samples") == [0, 8, 8]  # 2 prompts x rollout.n=4
    assert mlflow_metric(out, "rollout/partial_continued") == [0, 0, 0]
    for name in ("perf/trainer_busy_fraction", "perf/engine_busy_fraction"):
        assert all(0.0 <= x <= 1.0 for x in mlflow_metric(out, name)), name



def test_a_resumed_async_run_keeps_the_data_order(inputs, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    extra = ASYNC + ["tracking.log_rollouts_freq=1", "trainer.test_freq=0", "trainer.val_before_train=false"]
    train(load_config(None, tiny_overrides(inputs, straight, steps=4) + extra))
    train(load_config(None, tiny_overrides(inputs, split, steps=2) + extra))
    train(load_config(None, tiny_overrides(inputs, split, steps=4) + extra))  # resumes at step 2

    def prompts(out, step):
        table = json.loads(next((out / "mlartifacts").rglob(f"rollouts/step_{step:06d}.json")).read_text())
        column = table["columns"].index("prompt")
        return sorted(row[column] for row in table["data"])

    for step in (3, 4):  # the batches generated after the restart: the same prompts as straight through
        assert prompts(straight, step) == prompts(split, step)
    assert prompts(straight, 3) != prompts(straight, 4)


def test_async_needs_the_importance_correction(inputs, tmp_path):
    with pytest.raises(ConfigError, match="algorithm.tis_cap"):
        load_config(None, tiny_overrides(inputs, tmp_path, steps=1) + ["trainer.async_rollout.enable=true"])
    with pytest.raises(ConfigError, match="rollout.mode=colocated"):
        load_config(None, tiny_overrides(inputs, tmp_path, steps=1) + ASYNC + ["cluster.gpus_per_node=8"])


def test_a_preempted_generation_goes_on_under_the_new_weights():
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    engine = LocalEngine(copy.deepcopy(old), max_batch_size=4, eos_token_ids=[])
    prompt = [5, 17, 42, 8, 99, 3, 250]
    params = SamplingParams(max_new_tokens=300, temperature=1.0, seed=3)
    traj = Trajectory(prompt_ids=prompt)

    async def scenario():
        task = asyncio.ensure_future(generate_continued(engine, None, prompt, params, traj))
        while engine.tokens_generated < 10:
            await asyncio.sleep(0.001)
        await engine.abort_requests()  # as the asynchronous loop does before a sync (partial_rollouts=abort)
        await engine.begin_weight_update()
        await engine.update_weights([new.state_dict()], version=1)
        await engine.end_weight_update()
        try:
            return await task
        finally:
            await engine.close()

    out = asyncio.run(scenario())
    k = out.versions().count(0)  # tokens sampled before the abort
    assert 10 <= k < 300 and len(out.token_ids) == 300 and out.finish_reason == "length"
    assert out.versions() == [0] * k + [1] * (300 - k) and traj.num_continued == 1
    ids = out.token_ids
    torch.testing.assert_close(torch.tensor(out.log_probs[:k]), reference_log_probs(old, prompt, ids[:k]),
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(out.log_probs[k:]), reference_log_probs(new, prompt + ids[:k], ids[k:]),
                               atol=1e-4, rtol=0)


class ScriptedEngine:
    """A test double: answers generate calls with the outputs given, in order."""

    def __init__(self, outputs):
        self.outputs, self.calls = list(outputs), []

    async def generate(self, prompt_ids, params):
        self.calls.append((list(prompt_ids), params))
        return self.outputs.pop(0)


def test_a_stop_string_split_by_the_preemption_ends_the_generation():
    tok = tiny_tokenizer()
    first, second = tok.encode("think </ans"), tok.encode("wer> then more words")
    engine = ScriptedEngine([
        GenerationOutput(first, [-0.5] * len(first), "abort", message=PREEMPTED, weight_version=4),
        GenerationOutput(second, [-0.25] * len(second), "length", weight_version=5),
    ])
    params = SamplingParams(max_new_tokens=50, stop=("</answer>",), seed=11)
    out = asyncio.run(generate_continued(engine, tok, [1, 2, 3], params, Trajectory(prompt_ids=[1, 2, 3])))
    (_, p1), (prompt2, p2) = engine.calls
    assert prompt2 == [1, 2, 3] + first and p2.max_new_tokens == 50 - len(first) and p2.seed != p1.seed
    whole = first + second
    end = next(n for n in range(1, len(whole) + 1) if "</answer>" in tok.decode(whole[:n]))  # the slow reference
    assert out.token_ids == whole[:end] and out.finish_reason == "stop" and out.matched_stop == "</answer>"
    assert out.versions() == ([4] * len(first) + [5] * len(second))[:end]
    assert out.log_probs == ([-0.5] * len(first) + [-0.25] * len(second))[:end]


def test_sglang_weight_version_spans():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(spans, 5) == [3, 3, 4, 4, 4]
    assert version_spans([3, 3, 4, 4, 4]) == spans
    assert token_versions(spans, 6) is None  # a token no span covers: the output's weight_version stands
    assert token_versions([{"version": "v1", "start": 0, "end": 5}], 5) is None  # not megarl's step numbers
    assert token_versions(spans[::-1], 5) == [3, 3, 4, 4, 4]  # in any order
    overlapping = [{"version": "3", "start": 0, "end": 3}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(overlapping, 5) is None  # a token two spans cover


@pytest.mark.parametrize("level, expected", [("token", (math.exp(0.1) + 2.0) / 2),  # exp(0.8) capped at 2
                                             ("sequence", 2.0)])  # exp(0.1 + 0.8) > 2: capped
def test_truncated_importance_sampling_levels(level, expected):
    old = torch.zeros(1, 3)
    rollout = torch.tensor([[-0.1, -0.8, -5.0]])  # the third token is masked out
    mask = torch.tensor([[1, 1, 0]])
    _, metrics = policy_loss(old.clone().requires_grad_(), old, torch.ones(1, 3), mask, rollout_log_prob=rollout,
                             tis_cap=2.0, tis_level=level)
    assert metrics["tis_weight_mean"] == pytest.approx(expected, rel=1e-6)
