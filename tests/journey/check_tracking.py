"""The journey's run as the MLflow server recorded it: one run in the experiment, FINISHED,
with train/reward_mean at every step from 1 to STEPS (a preempted and resumed run logs into the
run it started), and no stop signal left on it.

    python tests/journey/check_tracking.py TRACKING_URI EXPERIMENT STEPS
"""

from __future__ import annotations

import sys

from mlflow.tracking import MlflowClient


def main(uri: str, experiment: str, steps: int) -> int:
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        print(f"check_tracking: no experiment {experiment!r} on {uri}", file=sys.stderr)
        return 1
    runs = client.search_runs([found.experiment_id])
    problems = [] if len(runs) == 1 else [f"{len(runs)} runs, not one"]
    for run in runs:
        logged = sorted({m.step for m in client.get_metric_history(run.info.run_id, "train/reward_mean")})
        if logged != list(range(1, steps + 1)):
            problems.append(f"run {run.info.run_id}: train/reward_mean at steps {logged}, not 1..{steps}")
        if run.info.status != "FINISHED" or "megarl.stop_signal" in run.data.tags:
            problems.append(f"run {run.info.run_id}: status {run.info.status}, tags {sorted(run.data.tags)}")
    if problems:
        print("check_tracking: " + "; ".join(problems), file=sys.stderr)
        return 1
    print(f"check_tracking: one FINISHED run on {uri} with every step 1..{steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
