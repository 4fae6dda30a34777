"""`megarl train` with actor.lora: the megatron backend at TP 2 (two CPU ranks as Ray actors) against
the torch backend's PEFT model on the same run, a KL term on (the reference: the base with the
adapters off): the same rollouts (the engine gets the merged weights after every step), the same
merged weights; `megarl export` writes both the merged model and PEFT's adapter, which gives the
merged model's log-probs on the base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from megarl.config import load_config
from megarl.export import export_checkpoint
from megarl.train import train
from train_fixtures import hf_weights as weights, mlflow_metric as metric, tiny_overrides

pytestmark = pytest.mark.megatron

LORA = ["actor.lora.r=8", "actor.lora.lora_alpha=16", "actor.optim.lr=1e-2", "algorithm.use_kl_loss=true",
        "algorithm.kl_loss_coef=0.1", "reward.custom_function=reward_fixtures:length_score"]


@pytest.fixture(autouse=True)
def ray_sees_the_tests(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # Ray's workers import reward_fixtures


@pytest.mark.slow
def test_a_lora_run_on_megatron_trains_like_the_torch_backend_and_exports_for_peft(tiny_inputs, tmp_path):
    torch_out, mg_out = tmp_path / "torch", tmp_path / "megatron"
    train(load_config(None, tiny_overrides(tiny_inputs, torch_out, 2) + LORA))
    mg = [o for o in tiny_overrides(tiny_inputs, mg_out, 2) if not o.startswith("cluster.launcher")]
    train(load_config(None, mg + LORA + ["cluster.launcher=ray", "actor.backend=megatron",
                                         "actor.parallel.tensor_model_parallel_size=2"]))
    want, got, base = weights(torch_out / "hf"), weights(mg_out / "hf"), weights(Path(tiny_inputs["model"]))
    assert got.keys() == want.keys() == base.keys()
    assert max(float((want[n] - base[n]).abs().max()) for n in want) > 1e-3  # the adapters moved the merged weights
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-4, msg=name)
    assert metric(mg_out, "train/reward_mean") == metric(torch_out, "train/reward_mean")  # the same rollouts
    assert metric(mg_out, "actor/kl_loss") == pytest.approx(metric(torch_out, "actor/kl_loss"), abs=1e-5)
    assert metric(mg_out, "actor/kl_loss")[-1] > 0  # the second step is away from the base

    export_checkpoint(mg_out, tmp_path / "exported")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    for name, tensor in weights(tmp_path / "exported").items():
        torch.testing.assert_close(tensor, got[name], rtol=0, atol=1e-6, msg=name)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_inputs["model"]),
                                        tmp_path / "exported" / "adapter").eval()
    ids = torch.tensor([[3, 17, 42, 9, 120, 5, 77, 8]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, merged(ids).logits, rtol=0, atol=1e-5)


def test_a_sync_that_leaves_the_adapters_out_is_caught_by_the_weights_probe(tiny_inputs, tmp_path, monkeypatch):
    """The engines given the base alone (the adapters not merged) serve other weights than the
    trainer's: the run stops at the first sync, before training on their samples."""
    from megarl.backends.torch.worker import TorchTrainWorker
    from megarl.weights.buckets import hf_tensors
    from megarl.weights.probe import WrongWeights

    def base_alone(self):  # the base layers' own weights under the HF names, no adapter in them
        inner = hf_tensors(self.actor.model.get_base_model())
        return ((n.replace(".base_layer.", "."), t) for n, t in inner if ".lora_" not in n)

    monkeypatch.setattr(TorchTrainWorker, "_hf_tensors", base_alone)
    with pytest.raises(WrongWeights, match="serves other weights than the trainer's"):
        train(load_config(None, tiny_overrides(tiny_inputs, tmp_path / "run", 2) + LORA))
