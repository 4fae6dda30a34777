"""The step's gate (sync.probe.gate): the engines' log-probs of the tokens they sampled with the
trainer's current weights against the trainer's old log-probs, before anything is trained on;
a batch refused is generated again after a reload, a second refusal stops the run by name."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.backends.packed import PackedBatch
from megarl.experience import Sample
from megarl.rollout.agent import Trajectory
from megarl.experience import EnginesDisagree, gate, on_policy_tokens
from megarl.weights.probe import WrongWeights


def sample(prompt: list[int], versions: list[int], mask: list[int]) -> Sample:
    t = Trajectory(prompt_ids=prompt, response_ids=[9] * len(versions), loss_mask=mask,
                   rollout_log_probs=[0.0] * len(versions), token_versions=versions)
    return Sample(None, 0, t)


def test_on_policy_tokens_are_the_trained_tokens_of_the_trainers_version():
    samples = [sample([1, 2], [4, 4, 5], [1, 1, 1]),  # a generation preempted by the sync to 5
               sample([3], [5, 5, 5, 5], [1, 0, 0, 1])]  # an observation (mask 0) between two turns
    t = [s.trajectory for s in samples]
    batch = PackedBatch.from_sequences([x.prompt_ids for x in t], [list(x.response_ids) for x in t],
                                       [list(x.loss_mask) for x in t])
    # row 0: prompt 2 tokens, then versions 4 4 5; row 1: prompt 1 token, then 5 5 5 5 masked 1 0 0 1
    want = [False, False, False, False, True, False, True, False, False, True]
    assert on_policy_tokens(samples, batch, 5).tolist() == want
    assert not on_policy_tokens(samples, batch, 6).any()  # all of it stale: nothing to judge


@pytest.mark.parametrize("differ, on_policy, bound, refused, mean", [
    ([0.1, 5.0, 0.3], [True, False, True], 0.25, False, 0.2),  # the stale token's 5.0 is not counted
    ([0.1, 5.0, 0.3], [True, True, True], 0.25, True, 1.8),
    ([float("nan"), 0.0], [True, True], 0.25, True, None),  # NaN never passes
    ([3.0], [False], 0.25, False, None),  # nothing to judge: passes, counted
])
def test_gate(differ, on_policy, bound, refused, mean):
    metrics: dict = {}
    if refused:
        with pytest.raises(EnginesDisagree, match=f"the {sum(on_policy)} tokens they sampled"):
            gate(torch.tensor(differ), torch.tensor(on_policy), bound, metrics)
    else:
        gate(torch.tensor(differ), torch.tensor(on_policy), bound, metrics)
    assert metrics["rollout/gate_tokens"] == sum(on_policy)
    if mean is not None:
        assert metrics["rollout/logprob_mismatch_on_policy"] == pytest.approx(mean)
    elif sum(on_policy):
        assert math.isnan(metrics["rollout/logprob_mismatch_on_policy"])


# -- whole runs: the engine's weights changed behind the run's back after the sync's probe

def changed_after_each_sync(monkeypatch, times: int):
    """After the first `times` syncs (probe included), the embedded engine's weights are changed."""
    from megarl.runtime.base import Runtime

    done = []
    original = Runtime.sync_weights

    def sync_then_change(self, version, check=True):
        original(self, version, check)
        if len(done) < times and version >= 1:
            done.append(version)
            with torch.no_grad():
                for p in self.engine.model.model.layers[0].mlp.parameters():
                    p.mul_(3.0)

    monkeypatch.setattr(Runtime, "sync_weights", sync_then_change)
    return done


def test_a_batch_from_changed_weights_is_generated_again_after_a_reload(tiny_inputs, tmp_path, monkeypatch):
    from megarl.config import load_config
    from megarl.train import train
    from train_fixtures import mlflow_metric, tiny_overrides

    changed = changed_after_each_sync(monkeypatch, times=1)
    train(load_config(None, tiny_overrides(tiny_inputs, tmp_path, steps=2) + ["trainer.test_freq=0"]))
    assert changed == [1]  # after step 1's sync: step 2 generated with changed weights, refused, regenerated
    assert mlflow_metric(tmp_path, "rollout/gate_regenerations") == [1.0]
    assert all(m <= 1e-3 for m in mlflow_metric(tmp_path, "rollout/logprob_mismatch_on_policy"))  # what trained


def test_an_engine_that_keeps_generating_with_other_weights_stops_the_run(tiny_inputs, tmp_path, monkeypatch):
    from megarl.config import load_config
    from megarl.train import train
    from train_fixtures import tiny_overrides

    changed_after_each_sync(monkeypatch, times=2)  # the reload's sync is followed by a change too
    with pytest.raises(WrongWeights, match=r"step 2, the engines' log-probs of the \d+ tokens they sampled with the "
                                           r"trainer's weights differ from the trainer's by [0-9.e-]+ a token "
                                           r"\(sync.probe.gate_bound=0.001\), again after"):
        train(load_config(None, tiny_overrides(tiny_inputs, tmp_path, steps=2) + ["trainer.test_freq=0"]))
