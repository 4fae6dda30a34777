"""algorithm.old_log_probs=engine: the PPO ratio's denominator taken from the log-probs the
engine returned with each sampled token, instead of a forward pass of the train model. On the
CPU in float32 the embedded engine and the trainer compute the same numbers up to float
rounding, so the run must end on the weights of the reference run (old log-probs from the
trainer) up to that rounding, without the trainer's forward for them."""

from __future__ import annotations

import pytest
import torch

from megarl.backends.torch.worker import TorchTrainWorker
from megarl.config import ConfigError, load_config
from megarl.train import train
from train_fixtures import hf_weights, mlflow_metric, tiny_overrides


def test_the_engines_log_probs_replace_the_forward_and_end_on_the_reference_weights(tiny_inputs, tiny_reference,
                                                                                   tmp_path, monkeypatch):
    calls = []
    forward = TorchTrainWorker.compute_log_prob

    def counted(self, batch, with_entropy=False, temperature=None, own_routing=False):
        if temperature is None:  # the step's forwards; the weights probe asks for temperature 1
            calls.append(batch.input_ids.shape)
        return forward(self, batch, with_entropy, temperature, own_routing)

    monkeypatch.setattr(TorchTrainWorker, "compute_log_prob", counted)
    out = tmp_path / "run"
    # the reference run's settings (train_fixtures.tiny_reference_run), the old log-probs from the engine
    train(load_config(None, tiny_overrides(tiny_inputs, out, 2) + [
        "reward.custom_function=reward_fixtures:length_score", "algorithm.old_log_probs=engine"]))
    assert calls == []
    assert len(mlflow_metric(out, "actor/pg_loss")) == 2
    reference, got = hf_weights(tiny_reference / "hf"), hf_weights(out / "hf")
    initial = hf_weights(tiny_inputs["model"])
    assert sorted(got) == sorted(reference)
    for name, tensor in reference.items():
        # Adam turns a rounding difference of a gradient into up to a few 1e-4 of a step (measured: 1.5e-6
        # against steps of 4e-3); log-probs that were not the sampling policy's move the weights by whole steps
        moved = float((tensor - initial[name]).abs().max())
        assert moved > 0, name
        assert float((got[name] - tensor).abs().max()) <= 2e-3 * moved, name


def test_engine_log_probs_with_truncated_importance_sampling_are_refused(tiny_inputs, tmp_path):
    with pytest.raises(ConfigError, match="algorithm.old_log_probs: is engine, but algorithm.tis_cap"):
        load_config(None, tiny_overrides(tiny_inputs, tmp_path) + ["algorithm.old_log_probs=engine",
                                                                   "algorithm.tis_cap=2.0"])
