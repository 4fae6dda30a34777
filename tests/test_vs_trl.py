"""tools/bench/vs_trl.py: the pure parts of the megarl-vs-TRL bench (per-step seconds from step end
times, which steps count as steady state, per-step metrics read back from megarl's MLflow store),
each against values worked out by hand."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
from vs_trl import mlflow_metrics, steady_mean, steady_steps, step_intervals  # noqa: E402


@pytest.mark.parametrize("begin, ends, expected", [
    (100.0, [102.5, 104.0, 109.0], [2.5, 1.5, 5.0]),
    (0.0, [3.0], [3.0]),
    (7.0, [], []),
])
def test_step_intervals(begin, ends, expected):
    assert step_intervals(begin, ends) == pytest.approx(expected)


@pytest.mark.parametrize("steps, save_every, expected", [
    # saves after steps 5, 10, 15 (and 20, after the last) fall into steps 6, 11, 16
    (20, 5, [2, 3, 4, 5, 7, 8, 9, 10, 12, 13, 14, 15, 17, 18, 19, 20]),
    (3, 2, [2]),  # a save after step 2 falls into step 3
    (4, 0, [2, 3, 4]),  # no saves: every step but the first
])
def test_steady_steps(steps, save_every, expected):
    assert steady_steps(steps, save_every) == expected


def test_steady_mean_takes_the_named_1_based_steps():
    assert steady_mean([9.0, 2.0, 4.0, 30.0, 3.0], [2, 3, 5]) == pytest.approx(3.0)  # (2 + 4 + 3) / 3


def test_mlflow_metrics_keeps_each_steps_last_value_in_seconds(tmp_path):
    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:  # the columns of MLflow's own metrics table that the bench reads
        con.execute("CREATE TABLE metrics (key TEXT, value REAL, timestamp INTEGER, run_uuid TEXT, step INTEGER)")
        con.executemany("INSERT INTO metrics VALUES (?, ?, ?, 'r', ?)", [
            ("perf/step_s", 2.5, 1_000_500, 1),
            ("perf/step_s", 1.5, 1_002_000, 2),
            ("perf/step_s", 1.25, 1_003_000, 2),  # step 2 logged again later: the later value counts
            ("timing/rollout_s", 0.75, 1_000_500, 1),
        ])
    assert mlflow_metrics(db) == {"perf/step_s": {1: (2.5, 1000.5), 2: (1.25, 1003.0)},
                                  "timing/rollout_s": {1: (0.75, 1000.5)}}
