"""`megarl train` with its rollouts on SGLang 0.5.23's own servers on the CPU: two engines behind
sglang-router, launched by Ray actors through megarl's launcher with the run's key, on the
quickstart (`make quickstart-sglang`: its inputs, warmed-up model and config, a few steps). It
learns with the weights synced after every step by the nccl transport's code over gloo; and
its multi-turn search runs asynchronously with partial rollouts, the weights through disk,
an engine killed mid-run (restarted, its newest weights reloaded, its requests re-sent)."""

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
from train_fixtures import mlflow_metric as metric

pytestmark = pytest.mark.sglang
KEY = "sglang-fleet-test-key"
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart" / "search_r1_tiny.yaml"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A directory holding the quickstart's inputs where its config looks for them
    (outputs/quickstart/...: the warmed-up model answers about 13% of the validation questions
    greedily and searches in about a third of its tries)."""
    root = tmp_path_factory.mktemp("quickstart")
    prepare(root / "outputs" / "quickstart")
    return root


def quickstart(python: str, out: Path, steps: int, extra: list[str]) -> None:
    """The quickstart's config on two SGLang servers from `python`, `steps` steps into `out`."""
    train(load_config(str(QUICKSTART), [
        "rollout.engine=sglang", "rollout.num_engines=2", f"rollout.sglang.python={python}",
        f"trainer.output_dir={out}", f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}",
        f"trainer.save_freq={steps}", "tracking.experiment_name=t", *extra]))


def sglang_servers(model_path: str) -> list[psutil.Process]:
    """The SGLang launcher processes serving a model whose path contains `model_path` (started
    through with_api_key)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "sglang.launch_server" in cmd and any(model_path in arg for arg in cmd):
            found.append(p)
    return found


def engine_killer(ready) -> tuple[threading.Thread, list[int]]:
    """A started thread that kills one quickstart SGLang server's process group once `ready()`
    (within 600 s), and the list it appends the killed pid to."""
    killed: list[int] = []

    def kill():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not ready():
            time.sleep(0.2)
        servers = sglang_servers("quickstart/model")
        if servers:
            os.killpg(os.getpgid(servers[0].pid), signal.SIGKILL)
            killed.append(servers[0].pid)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer, killed


def assert_sglang_served(out: Path) -> None:
    logs = {p.name: p.read_text(errors="replace") for p in (out / "logs").iterdir()}
    assert sorted(logs) == ["engine0.log", "engine1.log", "router.log"]
    for name in ("engine0.log", "engine1.log"):  # SGLang's own server, on its CPU engine
        assert "sglang.launch_server" in logs[name] and "--device cpu" in logs[name], logs[name][-2000:]
    assert all(KEY not in text for text in logs.values())


def test_the_quickstart_learns_on_two_sglang_servers_synced_over_a_gloo_group(world, tmp_path, sglang_env,
                                                                           monkeypatch):
    monkeypatch.chdir(world)  # the config's paths are relative: outputs/quickstart/...
    monkeypatch.setenv("MEGARL_ENGINE_API_KEY", KEY)
    out = tmp_path / "run"
    quickstart(sglang_env, out, 2, ["sync.transport=nccl"])
    # learning: measured 0.133 -> 0.983 (docs/fleet.md); the embedded engine gives the same
    acc = metric(out, "val/acc")
    assert len(acc) == 2 and acc[0] < 0.3 and acc[1] > acc[0] + 0.4, acc
    assert len(metric(out, "actor/pg_loss")) == 2
    # every rollout of step k was sampled with the weights of step k: SGLang's weight_version
    # of each sample is the sync that produced it
    assert metric(out, "rollout/stale_samples") == [0.0, 0.0]
    assert metric(out, "rollout/engine_restarts") == [0.0, 0.0]
    assert_sglang_served(out)
    assert not sglang_servers("quickstart/model")  # the run stopped its servers


@pytest.mark.full
def test_asynchronous_rollouts_of_search_survive_a_killed_sglang_server(world, tmp_path, sglang_env, monkeypatch):
    """The quickstart's multi-turn search, asynchronous, and one engine's process group killed
    once the first sync is on disk: the run restarts it, it reloads the newest weights, and every
    step trains. Partial rollouts are set (each sync aborts what is in flight) but do not engage
    here: the next batch is generated before the update ends, so each abort finds nothing. Their
    abort and continuation across a sync on SGLang's server are test_server.py's
    test_a_generation_across_a_weight_sync."""
    monkeypatch.chdir(world)
    monkeypatch.setenv("MEGARL_ENGINE_API_KEY", KEY)
    out = tmp_path / "run"
    killer, killed = engine_killer(lambda: list((out / "weight_sync").glob("v000001*")))
    quickstart(sglang_env, out, 3, ["sync.transport=disk", "trainer.async_rollout.enable=true",
                                    "trainer.async_rollout.partial_rollouts=abort", "algorithm.tis_cap=2.0",
                                    "trainer.val_before_train=false", "trainer.test_freq=0"])  # learning: above
    killer.join(timeout=60)
    assert killed, "no SGLang server was found to kill"
    assert len(metric(out, "actor/pg_loss")) == 3
    assert metric(out, "rollout/engine_restarts")[-1] >= 1
    assert all(0 <= s <= 1 for s in metric(out, "rollout/staleness_max"))
    assert min(metric(out, "rollout/search_calls_mean")) > 0.2  # multi-turn: the model searched
    assert_sglang_served(out)


@pytest.mark.full
def test_an_sglang_engine_whose_weights_change_behind_the_runs_back_is_repaired_before_training(world, tmp_path,
                                                                                                sglang_env,
                                                                                                monkeypatch):
    """After step 1's sync (and its probe), engine 0 is made to load other weights (the initial
    model with one layer's MLP scaled 3x) under version 1, as a wrong load would: step 2's batch
    comes from it. The gate (sync.probe.gate) finds its log-probs far from the trainer's, the
    engines get the trainer's weights again (the probe passes) and the batch is generated anew:
    nothing from the changed weights is trained on."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.driver_loop import run_async
    from megarl.runtime.base import Runtime
    from megarl.weights.buckets import group_tensors, hf_tensors
    from megarl.weights.disk import write_buckets

    monkeypatch.chdir(world)
    monkeypatch.setenv("MEGARL_ENGINE_API_KEY", KEY)
    other = AutoModelForCausalLM.from_pretrained(world / "outputs" / "quickstart" / "model", dtype=torch.float32)
    with torch.no_grad():
        for p in other.model.layers[0].mlp.parameters():
            p.mul_(3.0)
    changed = tmp_path / "changed"
    write_buckets(group_tensors(hf_tensors(other), 64 << 20), changed, "bucket")
    original, done = Runtime.sync_weights, []

    def sync_then_change(self, version, check=True):
        original(self, version, check)
        if version == 1 and not done:
            done.append(version)
            run_async(self.engine.servers[0].client.load_from_disk(str(changed), 1))

    monkeypatch.setattr(Runtime, "sync_weights", sync_then_change)
    out = tmp_path / "run"
    quickstart(sglang_env, out, 2, ["sync.transport=nccl", "trainer.val_before_train=false", "trainer.test_freq=0"])
    assert done == [1]
    assert metric(out, "rollout/gate_regenerations") == [1.0]  # step 2's first batch refused
    assert all(m <= 1e-3 for m in metric(out, "rollout/logprob_mismatch_on_policy"))  # what was trained on
    assert len(metric(out, "actor/pg_loss")) == 2


@pytest.mark.full
def test_the_quickstart_learns_with_lora_adapters_served_by_sglangs_lora_routes(world, tmp_path, sglang_env,
                                                                               monkeypatch):
    """actor.lora.sync=adapter (the lora transport): the servers keep the base and serve each
    step's adapter, loaded from PEFT's directory; the weights probe after every sync compares what
    they serve with the trainer's log-probs, so a run that ends has been served its adapters. One
    server is killed once the first adapter is on disk: restarted, it loads the newest adapter again."""
    monkeypatch.chdir(world)
    monkeypatch.setenv("MEGARL_ENGINE_API_KEY", KEY)
    out = tmp_path / "run"
    killer, killed = engine_killer((out / "weight_sync" / "v000001" / "adapter_config.json").exists)
    quickstart(sglang_env, out, 2, ["actor.lora.r=16", "actor.lora.lora_alpha=32", "actor.optim.lr=2e-3",
                                    "actor.lora.sync=adapter"])
    killer.join(timeout=60)
    assert killed, "no SGLang server was found to kill"
    assert metric(out, "rollout/engine_restarts")[-1] >= 1
    acc = metric(out, "val/acc")
    assert len(acc) == 2 and acc[1] > acc[0] + 0.3, acc
    assert metric(out, "rollout/stale_samples") == [0.0, 0.0]  # each sample reports its step's adapter version
    logs = [(out / "logs" / f"engine{i}.log").read_text(errors="replace") for i in (0, 1)]
    assert all("--enable-lora" in text and "--max-lora-rank 16" in text for text in logs)
    kept = sorted((out / "weight_sync").iterdir())  # the newest adapter, kept for a restarted engine
    assert [p.name for p in kept] == ["v000002"]
    assert sorted(p.name for p in kept[0].iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
