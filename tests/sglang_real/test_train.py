"""`megarl train` with its rollouts on SGLang 0.5.23's own servers on the CPU: two engines behind
sglang-router, launched by Ray actors through megarl's launcher with the run's key. The
quickstart (`make quickstart-sglang`, shortened to two steps) learns with the weights synced
after every step by the nccl transport's code over gloo; the tiny run of tests/train_fixtures.py
syncs through disk with asynchronous partial rollouts and an engine killed mid-run (restarted,
its newest weights reloaded, its requests re-sent)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from megarl.config import load_config
from megarl.quickstart import prepare
from megarl.train import train
from train_fixtures import mlflow_metric as metric, tiny_overrides, write_tiny_run_inputs

pytestmark = pytest.mark.sglang
KEY = "sglang-fleet-test-key"
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart" / "search_r1_tiny.yaml"


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
    """The SGLang launcher processes serving a model whose path contains `model_path` (started
    through with_api_key)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "sglang.launch_server" in cmd and any(model_path in arg for arg in cmd):
            found.append(p)
    return found


def assert_sglang_served(out: Path) -> None:
    logs = {p.name: p.read_text(errors="replace") for p in (out / "logs").iterdir()}
    assert sorted(logs) == ["engine0.log", "engine1.log", "router.log"]
    for name in ("engine0.log", "engine1.log"):  # SGLang's own server, on its CPU engine
        assert "sglang.launch_server" in logs[name] and "--device cpu" in logs[name], logs[name][-2000:]
    assert all(KEY not in text for text in logs.values())


def test_the_quickstart_learns_on_two_sglang_servers_synced_over_a_gloo_group(tmp_path, sglang_env, monkeypatch):
    # the quickstart's own inputs (the warmed-up model: it answers about 13% of the validation
    # questions greedily and searches in about a third of its tries), its config, two steps
    monkeypatch.chdir(tmp_path)  # the config's paths are relative: outputs/quickstart/...
    monkeypatch.setenv("MEGARL_ENGINE_API_KEY", KEY)
    prepare(Path("outputs/quickstart"))
    out = tmp_path / "run"
    train(load_config(str(QUICKSTART), [
        "rollout.engine=sglang", "rollout.num_engines=2", f"rollout.sglang.python={sglang_env}",
        "sync.transport=nccl", f"trainer.output_dir={out}", "trainer.total_training_steps=2", "trainer.test_freq=2",
        "trainer.save_freq=2", "tracking.experiment_name=t"]))
    # learning: measured 0.133 -> 0.983 (docs/fleet.md); the embedded engine gives the same
    acc = metric(out, "val/acc")
    assert len(acc) == 2 and acc[0] < 0.3 and acc[1] > acc[0] + 0.4, acc
    assert len(metric(out, "actor/pg_loss")) == 2
    # every rollout of step k was sampled with the weights of step k: SGLang's weight_version
    # of each sample is the sync that produced it
    assert metric(out, "rollout/stale_samples") == [0.0, 0.0]
    assert metric(out, "rollout/engine_restarts") == [0.0, 0.0]
    assert_sglang_served(out)
    assert not sglang_servers(str(tmp_path))  # the run stopped its servers


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
    assert_sglang_served(tmp_path)
