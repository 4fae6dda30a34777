"""`megarl train` with its rollouts on SGLang 0.5.23's own servers on the CPU: two engines behind
sglang-router, launched by Ray actors through megarl's launcher with the run's key, the weights
synced after every step by the nccl transport's code over gloo, or through disk with
asynchronous partial rollouts and an engine killed mid-run (restarted, its newest weights
reloaded, its requests re-sent). The tiny run of tests/train_fixtures.py; how the quickstart
learns on these servers is `make quickstart-sglang` (docs/fleet.md)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from megarl.config import load_config
from megarl.train import train
from train_fixtures import mlflow_metric as metric, tiny_overrides, write_tiny_run_inputs

pytestmark = pytest.mark.sglang
KEY = "sglang-fleet-test-key"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("inputs"))


def run(inputs, out: Path, python: str, steps: int, extra: list[str]) -> None:
    overrides = [o for o in tiny_overrides(inputs, out, steps) if not o.startswith("cluster.launcher")]
    train(load_config(None, overrides + [
        "reward.custom_function=reward_fixtures:length_score", "cluster.launcher=ray", "rollout.engine=sglang",
        "rollout.num_engines=2", f"rollout.sglang.python={python}", "rollout.sglang.max_total_tokens=4096",
        "rollout.max_concurrency=16", "rollout.sglang.startup_timeout_s=300", "rollout.sglang.health_timeout_s=60",
        "sync.verify=false", *extra]))  # sync.verify reads /weight_checksums, megarl's own route


def sglang_servers(model_path: str) -> list[psutil.Process]:
    """The SGLang launcher processes serving `model_path` (started through with_api_key)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "sglang.launch_server" in cmd and model_path in cmd:
            found.append(p)
    return found


def assert_sglang_served(out: Path, model_path: str) -> None:
    logs = {p.name: p.read_text(errors="replace") for p in (out / "logs").iterdir()}
    assert sorted(logs) == ["engine0.log", "engine1.log", "router.log"]
    for name in ("engine0.log", "engine1.log"):  # SGLang's own server, on its CPU engine
        assert "sglang.launch_server" in logs[name] and "--device cpu" in logs[name], logs[name][-2000:]
    assert all(KEY not in text for text in logs.values())


def test_training_on_two_sglang_servers_synced_over_a_gloo_group(inputs, tmp_path, sglang_env, monkeypatch):
    monkeypatch.setenv("MEGARL_ENGINE_API_KEY", KEY)
    run(inputs, tmp_path, sglang_env, 3, ["sync.transport=nccl"])
    assert len(metric(tmp_path, "actor/pg_loss")) == 3
    # every rollout of step k was sampled with the weights of step k: SGLang's weight_version
    # of each sample is the sync that produced it
    assert metric(tmp_path, "rollout/stale_samples") == [0.0, 0.0, 0.0]
    assert metric(tmp_path, "rollout/engine_restarts") == [0.0, 0.0, 0.0]
    assert len(metric(tmp_path, "val/acc")) == 4
    assert_sglang_served(tmp_path, inputs["model"])
    assert not sglang_servers(inputs["model"])  # the run stopped its servers


def test_asynchronous_partial_rollouts_survive_a_killed_sglang_server(inputs, tmp_path, sglang_env, monkeypatch):
    """Generations in flight at each sync aborted and continued, and one engine's process group
    killed once the first sync is on disk: the run restarts it, it reloads the newest weights,
    and every step trains."""
    monkeypatch.setenv("MEGARL_ENGINE_API_KEY", KEY)
    killed = []

    def kill_one_engine_after_the_first_sync():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not (tmp_path / "weight_sync" / "v000001").exists():
            time.sleep(0.2)
        servers = sglang_servers(inputs["model"])
        if servers:
            os.killpg(os.getpgid(servers[0].pid), signal.SIGKILL)
            killed.append(servers[0].pid)

    killer = threading.Thread(target=kill_one_engine_after_the_first_sync, daemon=True)
    killer.start()
    run(inputs, tmp_path, sglang_env, 4, ["sync.transport=disk", "trainer.async_rollout.enable=true",
                                          "trainer.async_rollout.partial_rollouts=abort", "algorithm.tis_cap=2.0",
                                          "rollout.max_response_length=12"])
    killer.join(timeout=60)
    assert killed, "no SGLang server was found to kill"
    assert len(metric(tmp_path, "actor/pg_loss")) == 4
    assert metric(tmp_path, "rollout/engine_restarts")[-1] >= 1
    assert all(0 <= s <= 1 for s in metric(tmp_path, "rollout/staleness_max"))
    assert_sglang_served(tmp_path, inputs["model"])
