"""Experiment tracking with MLflow: params, per-step metrics, artifacts, resumable runs.

By default the store is local, inside the run's output directory (`mlflow.db` plus
`mlartifacts/`), so no server is needed; `tracking.uri` points at a server instead. The
client API is used (no global mlflow state), and a resumed run logs into the same MLflow
run. `tracking.backend=none` gives a tracker that records nothing. Main entry point:
`open_tracker`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from megarl.config import TrackingConfig

log = logging.getLogger(__name__)
MAX_PARAM_CHARS = 6000  # MLflow's limit on one param value


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
    def close(self, status: str = "FINISHED") -> None: ...


class MLflowTracker:
    def __init__(self, cfg: TrackingConfig, output_dir: str | Path, run_id: str | None = None):
        from mlflow.tracking import MlflowClient

        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        self.uri = cfg.uri or local_store_uri(output_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        if run_id is not None:  # resume: same run, reopened
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(cfg.experiment_name)
        if experiment is None:
            artifacts = None if cfg.uri else str((output_dir / "mlartifacts").resolve())
            experiment_id = self.client.create_experiment(cfg.experiment_name, artifact_location=artifacts)
        else:
            experiment_id = experiment.experiment_id
        run = self.client.create_run(experiment_id, run_name=cfg.run_name or output_dir.resolve().name)
        self.run_id = run.info.run_id

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

    def close(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


def open_tracker(cfg: TrackingConfig, output_dir: str | Path, run_id: str | None = None):
    if cfg.backend == "none":
        return NullTracker()
    return MLflowTracker(cfg, output_dir, run_id)


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 3] + "..."
