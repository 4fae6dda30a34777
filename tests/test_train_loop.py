"""The training loop end to end on tiny inputs: steps, checkpoints, export, MLflow, resume."""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megarl.checkpoint import list_checkpoints
from megarl.config import load_config
from megarl.tracking import local_store_uri
from megarl.train import train
from train_fixtures import tiny_overrides, write_tiny_run_inputs

REQUIRED = ["train/reward_mean", "train/acc", "train/response_length_mean", "train/kept_groups", "train/gen_batches",
            "actor/pg_loss", "actor/clipfrac", "actor/entropy", "actor/grad_norm", "actor/lr",
            "rollout/search_calls_mean", "rollout/valid_action_rate", "rollout/logprob_mismatch", "rollout/stale_samples",
            "timing/rollout_s", "perf/tokens_per_s", "val/score", "val/acc"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("inputs"))


def test_two_step_micro_run(inputs, tmp_path, capsys):
    out = tmp_path / "run"
    train(load_config(None, tiny_overrides(inputs, out, steps=2) + ["trainer.val_before_train=true"]))
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_000001", "step_000002"]
    exported = AutoModelForCausalLM.from_pretrained(out / "hf")
    initial = AutoModelForCausalLM.from_pretrained(inputs["model"])
    assert not torch.equal(exported.model.embed_tokens.weight, initial.model.embed_tokens.weight)
    final = load_file(str(out / "checkpoints" / "step_000002" / "actor.safetensors"))
    torch.testing.assert_close(exported.state_dict()["lm_head.weight"], final["lm_head.weight"])

    client = MlflowClient(tracking_uri=local_store_uri(out))
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    for name in REQUIRED:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, name)]
        assert 1 in steps and 2 in steps, f"{name} logged at steps {steps}"
    assert run.data.params["rollout.n"] == "4"
    # every rollout was sampled with the weights of the step before it (version = steps done)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "rollout/stale_samples")] == [0, 0]
    assert run.info.status == "FINISHED"
    assert (out / "config.yaml").exists()
    # the closing summary quotes the first and last val/acc as MLflow recorded them
    val = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val/acc")}
    assert sorted(val) == [0, 1, 2]
    captured = capsys.readouterr()
    printed = captured.out
    assert f"val/acc: {val[0]:.3f} at step 0 -> {val[2]:.3f} at step 2" in printed
    # each step's line in the console log, with the accuracy MLflow recorded and the phases' seconds
    acc = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/acc")}
    lines = [line for line in captured.err.splitlines() if line.startswith("megarl step ")]
    assert [line.split(":")[0] for line in lines] == ["megarl step 1/2", "megarl step 2/2"]
    # before them, once the MLflow run is open: where to watch it while it runs
    first = [line for line in captured.err.splitlines() if line.startswith("megarl")][0]
    assert first == (f"megarl: MLflow run {run.info.run_id} in {out / 'mlflow.db'}; watch it while it runs: "
                     f"mlflow ui --backend-store-uri sqlite:///{(out / 'mlflow.db').resolve()} --host 127.0.0.1 "
                     "--port 5000")
    assert all(f"acc {acc[i + 1]:.3f}," in line and ": rollout " in line for i, line in enumerate(lines))
    assert f"HF export:   {out / 'hf'}" in printed and "mlflow ui --backend-store-uri sqlite:" in printed


def test_resume_gives_the_same_weights_and_metrics(inputs, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(load_config(None, tiny_overrides(inputs, straight, steps=4)))
    train(load_config(None, tiny_overrides(inputs, split, steps=2)))
    train(load_config(None, tiny_overrides(inputs, split, steps=4)))  # trainer.resume=auto picks step 2 up

    a = load_file(str(straight / "checkpoints" / "step_000004" / "actor.safetensors"))
    b = load_file(str(split / "checkpoints" / "step_000004" / "actor.safetensors"))
    for name in a:
        assert torch.equal(a[name], b[name]), name

    def history(out):
        client = MlflowClient(tracking_uri=local_store_uri(out))
        (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
        return run.info.run_id, {name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
                                 for name in ("train/reward_mean", "actor/pg_loss", "val/acc")}

    (_, straight_metrics), (_, split_metrics) = history(straight), history(split)  # one run each: same MLflow run resumed
    assert straight_metrics == split_metrics


def test_rollout_table_and_reward_curve_artifacts(inputs, tmp_path):
    out = tmp_path / "run"
    train(load_config(None, tiny_overrides(inputs, out, steps=2) + ["tracking.log_rollouts_freq=1"]))
    client = MlflowClient(tracking_uri=local_store_uri(out))
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    names = {a.path for a in client.list_artifacts(run.info.run_id, "rollouts")}
    assert names == {"rollouts/step_000001.json", "rollouts/step_000002.json"}
    assert "reward_curve.png" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert (out / "reward_curve.png").stat().st_size > 1000


def test_nan_steps_stop_the_run_after_saving(inputs, tmp_path, monkeypatch):
    from megarl.algo.registry import POLICY_LOSSES
    from megarl.train import TrainingStopped

    real = POLICY_LOSSES["ppo"]

    def nan_loss(*args, **kwargs):  # test double: a loss that went NaN
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setitem(POLICY_LOSSES, "ppo", nan_loss)
    out = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(inputs, out, steps=5) + ["trainer.max_bad_steps=2", "trainer.save_freq=0"])
    with pytest.raises(TrainingStopped, match="2 steps in a row"):
        train(cfg)
    (saved,) = list_checkpoints(out / "checkpoints")
    assert saved.name == "step_000002"
    initial = AutoModelForCausalLM.from_pretrained(inputs["model"]).state_dict()
    for name, tensor in load_file(str(saved / "actor.safetensors")).items():
        assert torch.equal(tensor, initial[name]), name  # skipped steps never touched the weights


def test_dynamic_sampling_refills_with_informative_groups(inputs, tmp_path):
    out = tmp_path / "run"
    overrides = tiny_overrides(inputs, out, steps=1) + [
        "algorithm.dynamic_sampling.enable=true", "algorithm.dynamic_sampling.max_num_gen_batches=20",
        "data.gen_batch_size=2", "data.train_batch_size=2", "data.shuffle=false",
        "reward.custom_function=reward_fixtures:odd_prompts_constant", "trainer.val_before_train=false",
        "trainer.test_freq=0", "algorithm.overlong.enable=false"]
    train(load_config(None, overrides))
    client = MlflowClient(tracking_uri=local_store_uri(out))
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    metric = {k: v for k, v in run.data.metrics.items()}
    # without shuffling each generation batch is one even and one odd prompt: at most one
    # informative group per batch, so filling 2 groups takes at least 2 batches
    assert metric["train/kept_groups"] == 2
    assert metric["train/gen_batches"] >= 2


def test_export_command_writes_a_loadable_hf_model(inputs, tmp_path, capsys):
    from megarl.cli import main

    out = tmp_path / "run"
    train(load_config(None, tiny_overrides(inputs, out, steps=1) + ["trainer.val_before_train=false"]))
    assert main(["export", "--run", str(out), "--out", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    saved = load_file(str(out / "checkpoints" / "step_000001" / "actor.safetensors"))
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name
    assert main(["export", "--run", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) != 0
    # a second export into the same directory is refused, as megarl convert refuses (issue 61, item 6)
    (tmp_path / "hf" / "mine.txt").write_text("keep")
    before = (tmp_path / "hf" / "model.safetensors").stat().st_mtime_ns
    assert main(["export", "--run", str(out), "--out", str(tmp_path / "hf")]) == 1
    assert "is not empty; give a new directory" in capsys.readouterr().err
    assert (tmp_path / "hf" / "mine.txt").read_text() == "keep"
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.full
def test_ray_launcher_trains_exactly_like_one_process(inputs, tmp_path):
    """The same 2 steps with the worker and the engine as Ray actors: identical weights."""
    local, distributed = tmp_path / "local", tmp_path / "ray"
    common = ["trainer.val_before_train=false", "trainer.test_freq=0"]
    train(load_config(None, tiny_overrides(inputs, local, steps=2) + common))
    train(load_config(None, tiny_overrides(inputs, distributed, steps=2) + common +
                      ["cluster.launcher=ray", "cluster.cpus_per_node=3"]))
    a = load_file(str(local / "checkpoints" / "step_000002" / "actor.safetensors"))
    b = load_file(str(distributed / "checkpoints" / "step_000002" / "actor.safetensors"))
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_rows_no_reward_scores_stop_the_run_before_it_starts(inputs, tmp_path, capsys):
    """Issue 61, item 7: rows of a data_source no reward knows scored 0 with a logged failure,
    and the run trained to the end on nothing. The data sources are known when the data loads."""
    import pyarrow.parquet as pq

    from megarl.cli import main

    table = pq.read_table(inputs["train"])
    sources = table.column("data_source").to_pylist()
    mystery = table.set_column(table.schema.get_field_index("data_source"), "data_source",
                               [["mystery_set" if i % 3 == 0 else s for i, s in enumerate(sources)]])
    pq.write_table(mystery, tmp_path / "train.parquet")
    out = tmp_path / "run"
    overrides = tiny_overrides({**inputs, "train": str(tmp_path / "train.parquet")}, out, steps=1)
    assert main(["train", *overrides]) == 1
    err = capsys.readouterr().err
    rows = sum(1 for i in range(len(sources)) if i % 3 == 0)
    assert f"no reward scores data_source 'mystery_set' ({rows} rows)" in err and "reward.data_sources" in err
    assert not (out / "checkpoints").exists()
    # named in reward.data_sources, the same data trains
    assert main(["train", *overrides, "reward.data_sources={mystery_set: search_r1_em}"]) == 0


@pytest.mark.slow
def test_a_run_whose_every_reward_fails_stops_as_failed(inputs, tmp_path, capsys):
    """A reward that can score nothing (here: it returns a string) fails every sample: after
    trainer.max_rewardless_steps such steps the run stops, exit 1, MLflow FAILED; before, it
    trained to the end on zeros and ended FINISHED."""
    from megarl.cli import main

    out = tmp_path / "run"
    assert main(["train", *tiny_overrides(inputs, out, steps=5), "trainer.test_freq=0", "trainer.val_before_train=false",
                 "reward.custom_function=reward_fixtures:wrong_type_score", "trainer.max_rewardless_steps=2"]) == 1
    assert "every sample's reward failed in 2 steps in a row" in capsys.readouterr().err
    client = MlflowClient(tracking_uri=local_store_uri(out))
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert run.info.status == "FAILED"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "reward/failure_rate")] == [1.0, 1.0]


def test_validation_reports_each_data_source_where_there_are_several():
    from megarl.data.prompts import PromptRecord
    from megarl.experience import Sample
    from megarl.run_report import per_source_accuracy as _per_source

    def sample(source, acc):
        return Sample(PromptRecord([1], source, "a"), 0, None, acc=acc)

    # nq: 1 of 2 right; hotpotqa: 2 of 3; "pop/qa?": 0 of 1 (its key made of MLflow's characters)
    samples = [sample("nq", True), sample("nq", False), sample("hotpotqa", True), sample("hotpotqa", True),
               sample("hotpotqa", False), sample("pop/qa?", False)]
    assert _per_source(samples) == {"val/acc/nq": 0.5, "val/acc/hotpotqa": 2 / 3, "val/acc/pop_qa_": 0.0}
    assert _per_source(samples[:2]) == {}  # one source: val/acc says it
