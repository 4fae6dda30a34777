"""`megarl train` generating with the engine-server fleet on CPU (rollout.engine=sglang,
rollout.sglang.server=embedded: megarl's engine servers behind sglang-router, launched by
Ray actors) and syncing weights over a gloo process group or through disk, with
sync.verify on. Per-request seeds make the rollouts independent of which engine serves
them, so the run must end on exactly the weights of the run with the in-process engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.config import load_config
from megarl.train import train
from train_fixtures import hf_weights as weights, mlflow_metric as metric, tiny_overrides

FLEET = ["rollout.engine=sglang", "rollout.sglang.server=embedded", "rollout.num_engines=2", "sync.verify=true",
         "rollout.sglang.startup_timeout_s=120"]


@pytest.fixture(scope="module")
def inputs(tiny_inputs):
    return tiny_inputs


@pytest.fixture(scope="module", autouse=True)
def ray_sees_the_tests():
    # the reward actor imports reward_fixtures by name; Ray's worker processes inherit PYTHONPATH
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(Path(__file__).parent))
        yield


def run(inputs, out: Path, extra: list[str]) -> None:
    overrides = [o for o in tiny_overrides(inputs, out, 2) if not o.startswith("cluster.launcher")]
    train(load_config(None, overrides + ["reward.custom_function=reward_fixtures:length_score",
                                         "cluster.launcher=ray", *extra]))



@pytest.fixture(scope="module")
def local_run(tiny_reference):
    """The same run with the in-process engine."""
    return tiny_reference


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["nccl", pytest.param("disk", marks=pytest.mark.full)])
def test_the_fleet_trains_exactly_like_the_embedded_engine(inputs, local_run, tmp_path, transport):
    run(inputs, tmp_path, FLEET + [f"sync.transport={transport}"])
    want, got = weights(local_run / "hf"), weights(tmp_path / "hf")
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert metric(tmp_path, "train/reward_mean") == metric(local_run, "train/reward_mean")
    assert metric(tmp_path, "val/acc") == metric(local_run, "val/acc")
    # every rollout of step k was sampled with the weights of step k (synced after each update)
    assert metric(tmp_path, "rollout/stale_samples") == [0.0, 0.0]
    assert metric(tmp_path, "rollout/engine_restarts") == [0.0, 0.0]
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["engine0.log", "engine1.log", "router.log"]
    if transport == "disk":  # only the newest weights stay on disk (a restarted engine reloads them)
        assert [p.name for p in (tmp_path / "weight_sync").iterdir()] == ["v000002"]


@pytest.mark.slow
def test_the_fleet_trains_asynchronously_with_partial_rollouts(inputs, tmp_path):
    """Asynchronous rollouts over the fleet, generations in flight at a sync aborted through the
    router's engines (/abort_request) and continued: both steps train, and no trained token
    lags more than the staleness bound (1) behind the weights it is trained from."""
    run(inputs, tmp_path, FLEET + ["sync.transport=disk", "trainer.async_rollout.enable=true",
                                   "trainer.async_rollout.partial_rollouts=abort", "algorithm.tis_cap=2.0"])
    assert len(metric(tmp_path, "actor/pg_loss")) == 2
    assert metric(tmp_path, "rollout/staleness_max")[0] == 0  # batch 0: the initial weights, trained at step 0
    assert all(0 <= s <= 1 for s in metric(tmp_path, "rollout/staleness_max"))
    assert metric(tmp_path, "rollout/engine_restarts") == [0.0, 0.0]


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.full
def test_megatron_pipeline_stages_each_sync_over_their_own_group(inputs, local_run, tmp_path):
    # PP=2: two source ranks, two update groups, each engine joins both
    run(inputs, tmp_path, FLEET + ["sync.transport=nccl", "actor.backend=megatron",
                                   "actor.parallel.pipeline_model_parallel_size=2"])
    want, got = weights(local_run / "hf"), weights(tmp_path / "hf")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-4, msg=name)
    assert metric(tmp_path, "train/reward_mean") == metric(local_run, "train/reward_mean")
