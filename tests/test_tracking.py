"""MLflow tracking read back with the MLflow client: params, metrics, artifacts, resume."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from megarl.config import TrackingConfig
from megarl.tracking import NullTracker, local_store_uri, open_tracker, ui_command


def test_local_store_round_trip_and_resume(tmp_path):
    cfg = TrackingConfig(experiment_name="exp")
    tracker = open_tracker(cfg, tmp_path)
    tracker.log_params({"algorithm.clip_ratio_high": 0.28, "data.train_files": ["a.parquet"], "x": "y" * 7000})
    tracker.log_metrics({"train/acc": 0.25, "actor/grad_norm": float("nan")}, step=1)
    tracker.log_text("algorithm: {}\n", "config.yaml")
    tracker.log_table({"prompt": ["p1"], "response": ["r1"], "reward": [1.0]}, "rollouts/step_000001.json")
    tracker.close()
    resumed = open_tracker(cfg, tmp_path, run_id=tracker.run_id)
    resumed.log_metrics({"train/acc": 0.75}, step=2)
    resumed.close()

    client = MlflowClient(tracking_uri=local_store_uri(tmp_path))
    run = client.get_run(tracker.run_id)
    assert run.data.params["algorithm.clip_ratio_high"] == "0.28"
    assert run.data.params["data.train_files"] == '["a.parquet"]'
    assert len(run.data.params["x"]) == 6000
    history = client.get_metric_history(tracker.run_id, "train/acc")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    assert client.get_metric_history(tracker.run_id, "actor/grad_norm") == []  # non-finite values are dropped
    artifacts = {a.path for a in client.list_artifacts(tracker.run_id)}
    assert {"config.yaml", "rollouts"} <= artifacts
    assert run.info.status == "FINISHED"
    assert (tmp_path / "mlflow.db").exists() and str(tmp_path) in ui_command(tmp_path)


def test_none_backend_records_nothing(tmp_path):
    tracker = open_tracker(TrackingConfig(backend="none"), tmp_path)
    assert isinstance(tracker, NullTracker)
    tracker.log_metrics({"a": 1.0}, 1)
    assert list(tmp_path.iterdir()) == []


def test_mlflows_own_tracking_uri_variable_is_honoured_and_the_config_beats_it(tmp_path, monkeypatch):
    from megarl.run_report import summary, tracking_line

    server_store = f"sqlite:///{tmp_path / 'server.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server_store)
    cfg = TrackingConfig(experiment_name="exp")
    tracker = open_tracker(cfg, tmp_path / "out")
    tracker.log_metrics({"train/acc": 0.5}, step=1)
    tracker.close()
    assert not (tmp_path / "out" / "mlflow.db").exists()
    history = MlflowClient(tracking_uri=server_store).get_metric_history(tracker.run_id, "train/acc")
    assert [(m.step, m.value) for m in history] == [(1, 0.5)]
    assert f"  MLflow:      {server_store}" in summary("finished", tmp_path / "out", [], cfg).splitlines()
    assert tracking_line(cfg, tmp_path / "out", "abc") == f"megarl: MLflow run abc on {server_store}: watch it there"
    assert tracking_line(TrackingConfig(backend="none"), tmp_path / "out", None) is None

    explicit = TrackingConfig(experiment_name="exp", uri=f"sqlite:///{tmp_path / 'explicit.db'}")
    other = open_tracker(explicit, tmp_path / "out2")
    other.close()
    assert MlflowClient(tracking_uri=explicit.uri).get_run(other.run_id).info.status == "FINISHED"


def test_a_step_is_one_line_of_the_console_log():
    from megarl.run_report import step_line

    metrics = {"train/reward_mean": 0.25, "train/acc": 0.3125, "train/response_length_mean": 143.25,
               "rollout/logprob_mismatch": 0.00412, "actor/pg_loss": 0.1, "timing/rollout_s": 4.12,
               "timing/old_log_prob_s": 0.81, "timing/update_actor_s": 6.24, "timing/sync_weights_s": 0.33,
               "perf/step_s": 11.57}
    assert step_line(3, 20, metrics) == ("megarl step 3/20: reward 0.250, acc 0.312, length 143.2, mismatch 0.0041 | "
                                         "11.6 s: rollout 4.1, old_log_prob 0.8, update_actor 6.2, sync_weights 0.3")
    assert step_line(20, 20, {"train/acc": 1.0, "val/acc": 0.5}) == "megarl step 20/20: acc 1.000, val/acc 0.500"
