"""`megarl train` with actor.backend=megatron at TP=2 (two CPU ranks as Ray actors) and at CP=2
against the torch backend on the same run: the same rollouts, rewards and weights; megatron
checkpoints resume; a dead rank is named. (Packed micro-batches are checked against the torch
backend step by step in test_megatron_numerics and test_megatron_worker.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from megarl.config import load_config
from megarl.export import export_checkpoint
from megarl.train import train
from train_fixtures import hf_weights as weights, mlflow_metric as metric, tiny_overrides

pytestmark = pytest.mark.megatron  # megatron-core runs here: make test-compat runs these on its newest release too

MEGATRON = ["actor.backend=megatron", "actor.parallel.tensor_model_parallel_size=2"]


@pytest.fixture(scope="module")
def inputs(tiny_inputs):
    return tiny_inputs


@pytest.fixture(autouse=True)
def ray_sees_the_tests(monkeypatch):
    # the reward actor imports reward_fixtures by name; Ray's worker processes inherit PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))


def run(inputs, out: Path, steps: int, extra: list[str]) -> dict:
    # a reward that varies with the response length, so every step has non-zero advantages
    overrides = [o for o in tiny_overrides(inputs, out, steps) if not o.startswith("cluster.launcher")]
    overrides += ["reward.custom_function=reward_fixtures:length_score", "cluster.launcher=ray", *extra]
    return train(load_config(None, overrides))



@pytest.fixture(scope="module")
def torch_run(tiny_reference):
    """The same run on the torch backend (the reference of the megatron runs)."""
    return tiny_reference


@pytest.mark.slow
@pytest.mark.full
def test_megatron_tp2_trains_like_the_torch_backend_and_resumes(inputs, torch_run, tmp_path):
    torch_out, mg_out, resumed = torch_run, tmp_path / "megatron", tmp_path / "resumed"
    run(inputs, mg_out, 2, MEGATRON)
    want, got, initial = weights(torch_out / "hf"), weights(mg_out / "hf"), weights(Path(inputs["model"]))
    assert got.keys() == want.keys()
    moved = max(float((want[n] - initial[n]).abs().max()) for n in want)
    assert moved > 1e-3  # two policy updates moved the weights
    for name in want:  # Adam on the same gradients within fp32 rounding
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-4, msg=name)
    # identical rollouts (the engine received the same weights) and the same losses
    assert metric(mg_out, "train/reward_mean") == metric(torch_out, "train/reward_mean")
    assert metric(mg_out, "actor/pg_loss") == pytest.approx(metric(torch_out, "actor/pg_loss"), abs=1e-5)
    assert (mg_out / "checkpoints" / "step_000002" / "megatron_trainer.json").exists()
    export_checkpoint(mg_out, tmp_path / "exported")  # megarl export reads the TP=2 distributed checkpoint
    exported = weights(tmp_path / "exported")
    for name in got:
        assert torch.equal(exported[name], got[name]), name

    run(inputs, resumed, 1, MEGATRON)
    run(inputs, resumed, 2, MEGATRON)  # trainer.resume=auto: step 1's distributed checkpoint
    again = weights(resumed / "hf")
    for name in got:
        torch.testing.assert_close(again[name], got[name], rtol=0, atol=1e-6, msg=name)
    assert metric(resumed, "train/reward_mean") == metric(mg_out, "train/reward_mean")
    assert not ray.is_initialized()


@pytest.mark.slow
def test_megatron_context_parallel_trains_like_the_torch_backend(inputs, torch_run, tmp_path):
    run(inputs, tmp_path, 2, MEGATRON[:1] + ["actor.parallel.context_parallel_size=2"])  # sequences over two ranks
    want, got = weights(torch_run / "hf"), weights(tmp_path / "hf")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-4, msg=name)
    assert metric(tmp_path, "train/reward_mean") == metric(torch_run, "train/reward_mean")
    assert metric(tmp_path, "actor/pg_loss") == pytest.approx(metric(torch_run, "actor/pg_loss"), abs=1e-5)


@pytest.mark.slow
def test_a_dead_rank_is_named_and_the_others_are_stopped(inputs, tmp_path):
    from megarl.backends.batch import TrainBatch
    from megarl.components import ComponentDied, build_components

    overrides = [o for o in tiny_overrides(inputs, tmp_path, 1) if not o.startswith("cluster.launcher")]
    c = build_components(load_config(None, overrides + MEGATRON + ["cluster.launcher=ray", "tracking.backend=none"]))
    try:
        batch = TrainBatch.from_sequences([[1, 2, 3]] * 2, [[4, 5]] * 2, [[1, 1]] * 2)
        assert c.worker.compute_log_prob(batch)[0].shape == (2, 5)
        ray.kill(c.runtime.worker_actors[1])
        with pytest.raises(ComponentDied, match=r"train worker rank 1 \(Ray actor TrainWorkerActor\) on node \S+ "
                                                r"\(127\.0\.0\.1\) died"):
            c.worker.compute_log_prob(batch)
    finally:
        c.close()
    assert not ray.is_initialized()


@pytest.mark.slow
def test_ppo_with_critic_and_kl_reference_trains_like_the_torch_backend(inputs, tmp_path):
    ppo = ["algorithm.adv_estimator=gae", "critic.enable=true", "critic.ppo_mini_batch_size=1",
           "critic.ppo_micro_batch_size=2", "critic.optim.lr=1e-3", "critic.optim.lr_warmup_steps=0",
           "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1"]
    megatron_critic = ["critic.backend=megatron", "critic.parallel.tensor_model_parallel_size=2"]
    run(inputs, tmp_path / "torch", 2, ppo)
    # the megatron run keeps its reference in host memory between uses (actor.reference_offload)
    run(inputs, tmp_path / "megatron", 2, ppo + MEGATRON + megatron_critic + ["actor.reference_offload=true"])
    want, got = weights(tmp_path / "torch" / "hf"), weights(tmp_path / "megatron" / "hf")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-4, msg=name)
    for key, tolerance in (("critic/vf_loss", 1e-5), ("actor/kl_loss", 1e-6), ("critic/vpred_mean", 1e-5)):
        expected = metric(tmp_path / "torch", key)
        assert len(expected) == 2 and metric(tmp_path / "megatron", key) == pytest.approx(expected, abs=tolerance), key
    assert metric(tmp_path / "megatron", "actor/kl_loss")[-1] > 0  # the second step is away from the reference
