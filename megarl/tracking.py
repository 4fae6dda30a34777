"""Experiment tracking with MLflow: params, per-step metrics, artifacts, resumable runs.

By default the store is local, inside the run's output directory (`mlflow.db` plus
`mlartifacts/`), so no server is needed; `tracking.uri`, or else MLflow's own
MLFLOW_TRACKING_URI in the environment, points at a server instead. The
client API is used (no global mlflow state). `tracking.backend=none` gives a tracker that
records nothing. Main entry point: `open_tracker`.

One output directory, one MLflow run: a resumed run logs into the run its checkpoint names,
and a rerun of a run stopped before its first checkpoint (same output directory, same
config, trainer.resume=auto) reopens the run recorded in `<output_dir>/mlflow_run.json`
instead of opening a second one; it starts again from step 0, so the steps the stopped
attempt logged are logged again (MLflow keeps both values at those steps). A rerun with
another config opens a new run. A recorded run still marked RUNNING that is not reopened
(its process was killed with SIGKILL, or by the OOM killer) is closed as KILLED. A run
stopped by a signal is KILLED with the tag `megarl.stop_signal` (SIGTERM, SIGINT), removed
again when it is reopened.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from megarl.config import TrackingConfig

log = logging.getLogger(__name__)
MAX_PARAM_CHARS = 6000  # MLflow's limit on one param value
RUN_FILE = "mlflow_run.json"  # in the output directory: its MLflow run, for a rerun before the first checkpoint
STOP_SIGNAL_TAG = "megarl.stop_signal"


def server_uri(cfg: TrackingConfig) -> str | None:
    """The tracking server's URI: tracking.uri, else $MLFLOW_TRACKING_URI (as MLflow reads it);
    None for the local store inside the output directory."""
    return cfg.uri or os.environ.get("MLFLOW_TRACKING_URI") or None


def local_store_uri(output_dir: str | Path) -> str:
    return f"sqlite:///{(Path(output_dir) / 'mlflow.db').resolve()}"


def ui_command(output_dir: str | Path) -> str:
    """The command that opens the MLflow UI on a run's local store."""
    return f"mlflow ui --backend-store-uri {local_store_uri(output_dir)} --host 127.0.0.1 --port 5000"


class NullTracker:
    run_id: str | None = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_table(self, columns: dict[str, list], artifact_file: str) -> None: ...
    def log_artifact(self, path: str | Path, artifact_dir: str | None = None) -> None: ...
    def close(self, status: str = "FINISHED", stop_signal: str | None = None) -> None: ...


class MLflowTracker:
    def __init__(self, cfg: TrackingConfig, output_dir: str | Path, run_id: str | None = None,
                 rerun_params: dict[str, Any] | None = None):
        from mlflow.tracking import MlflowClient

        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        server = server_uri(cfg)
        self.uri = server or local_store_uri(output_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        recorded = self._recorded_run(output_dir)
        if run_id is None and rerun_params is not None and recorded is not None and _same_run(recorded, rerun_params):
            run_id = recorded.info.run_id
            log.info("MLflow run %s stopped before its first checkpoint: this run continues it from step 0", run_id)
        if recorded is not None and recorded.info.run_id != run_id and recorded.info.status == "RUNNING":
            log.warning("MLflow run %s of %s was still marked RUNNING (its process was killed without a chance to "
                        "close it): closed as KILLED", recorded.info.run_id, output_dir)
            self.client.set_terminated(recorded.info.run_id, status="KILLED")
        if run_id is not None:  # resume or rerun: same run, reopened
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            if STOP_SIGNAL_TAG in self.client.get_run(run_id).data.tags:
                self.client.delete_tag(run_id, STOP_SIGNAL_TAG)
        else:
            experiment = self.client.get_experiment_by_name(cfg.experiment_name)
            if experiment is None:
                artifacts = None if server else str((output_dir / "mlartifacts").resolve())
                experiment_id = self.client.create_experiment(cfg.experiment_name, artifact_location=artifacts)
            else:
                experiment_id = experiment.experiment_id
            run = self.client.create_run(experiment_id, run_name=cfg.run_name or output_dir.resolve().name)
            self.run_id = run.info.run_id
        (output_dir / RUN_FILE).write_text(json.dumps({"run_id": self.run_id, "tracking_uri": self.uri}) + "\n")

    def _recorded_run(self, output_dir: Path):
        """The run `<output_dir>/mlflow_run.json` names, when this store has it (not deleted)."""
        try:
            run_id = json.loads((output_dir / RUN_FILE).read_text())["run_id"]
            run = self.client.get_run(run_id)
        except Exception as e:  # no file, another store, a deleted run: nothing to reopen or close
            log.debug("no recorded MLflow run in %s: %s", output_dir, e)
            return None
        return run if run.info.lifecycle_stage == "active" else None

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, _param_text(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and math.isfinite(float(v))]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_table(self, columns: dict[str, list], artifact_file: str) -> None:
        self.client.log_table(self.run_id, columns, artifact_file)

    def log_artifact(self, path: str | Path, artifact_dir: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_dir)

    def close(self, status: str = "FINISHED", stop_signal: str | None = None) -> None:
        """status: FINISHED, FAILED, or KILLED (stopped from outside: a signal, named by stop_signal)."""
        if stop_signal is not None:
            self.client.set_tag(self.run_id, STOP_SIGNAL_TAG, stop_signal)
        self.client.set_terminated(self.run_id, status=status)


def open_tracker(cfg: TrackingConfig, output_dir: str | Path, run_id: str | None = None,
                 rerun_params: dict[str, Any] | None = None):
    """The run's tracker. run_id: the MLflow run a checkpoint names (a resume reopens it).
    rerun_params: the config about to be logged, for a start from step 0 that may reopen the
    output directory's unfinished run (module docstring)."""
    if cfg.backend == "none":
        return NullTracker()
    return MLflowTracker(cfg, output_dir, run_id, rerun_params)


def _same_run(run, params: dict[str, Any]) -> bool:
    """An unfinished run whose params (those it got to log) are these params."""
    logged = run.data.params
    return run.info.status != "FINISHED" and all(logged[k] == _param_text(params.get(k)) for k in logged)


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 3] + "..."
