"""tools/bench/vs_trl.py: the pure parts of the megarl-vs-TRL bench (per-step seconds from step end
times, which steps count as steady state, per-step metrics read back from megarl's MLflow store, what
counts as a collapse, the accuracy verdict over seeds read back from a results file), each against
values worked out by hand; and tools/bench/megarl_switched.py's switches to TRL's settings."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
import megarl_switched  # noqa: E402
from vs_trl import (SideRun, collapsed, mlflow_metrics, report, steady_mean, steady_steps,  # noqa: E402
                    step_intervals, steps_alike)


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


@pytest.mark.parametrize("val, expected", [
    ({0: 0.2, 5: 0.0, 20: 0.1}, False),  # half the start is not under it
    ({0: 0.2, 5: 0.3, 20: 0.099}, True),
    ({0: 0.2, 20: 0.0}, True),
    ({0: 0.2, 10: 0.0, 20: 0.25}, False),  # recovered by the last step
])
def test_collapsed_is_the_final_accuracy_under_half_the_start(val, expected):
    assert collapsed(val) is expected


def test_the_verdict_compares_megarl_with_an_earlier_runs_trl_side(tmp_path, capsys):
    def run(val):
        return SideRun(step_s=[1.0, 1.0], phases={"update": [1.0, 1.0]}, launch=0.0, loop_start=1.0, last_step_end=3.0,
                       exit=4.0, val=val)

    megarl = {0: run({0: 0.2, 2: 0.15}), 1: run({0: 0.2, 2: 0.0})}  # mean 0.075, seed 1 collapsed
    trl = {"sides": {"trl": {"0": {"val": {"0": 0.2, "2": 0.05}}, "1": {"val": {"0": 0.2, "2": 0.12}}}}}
    (tmp_path / "trl.json").write_text(json.dumps(trl))  # mean 0.085, seed 0 collapsed
    report({"megarl": megarl}, keep=[2], compare=tmp_path / "trl.json")
    out = capsys.readouterr().out
    assert "megarl 0.075, TRL 0.085; collapsed: megarl 1, TRL 1" in out
    assert "missed" in out.splitlines()[-1]  # a lower mean misses however few collapse


def test_the_adv_eps_switch_divides_by_std_plus_1e_4(monkeypatch):
    import megarl.algo.advantages as advantages
    from megarl.algo import advantage_estimator
    from megarl.config import AlgorithmConfig

    monkeypatch.setattr(advantages, "compute_grpo_advantages", advantages.compute_grpo_advantages)  # restored after
    megarl_switched.switch_adv_eps()
    # one group [1, -1, -1, -1]: mean -0.5, Bessel std sqrt((1.5^2 + 3 * 0.5^2) / 3) = 1; through the
    # estimator a run's config names
    got = advantage_estimator("grpo").fn(torch.tensor([1.0, -1.0, -1.0, -1.0]), torch.tensor([0, 0, 0, 0]),
                                         AlgorithmConfig())
    assert got.tolist() == pytest.approx([1.5 / 1.0001, -0.5 / 1.0001, -0.5 / 1.0001, -0.5 / 1.0001], abs=1e-7)


def test_the_step_tokens_switch_divides_each_mini_batch_by_the_steps_tokens_over_its_mini_batches(monkeypatch):
    import megarl.backends.torch.actor as actor_module
    from megarl.backends.batch import TrainBatch
    from megarl.config import AlgorithmConfig, OptimConfig
    from tiny_models import tiny_model

    monkeypatch.setattr(actor_module.TorchActor, "update_actor", actor_module.TorchActor.update_actor)  # restored
    megarl_switched.switch_step_tokens()
    seen = []
    plain = actor_module.actor_loss
    monkeypatch.setattr(actor_module, "actor_loss", lambda *a, **k: seen.append(a[4]["num_tokens"]) or plain(*a, **k))
    # 4 rows of 1, 2, 3, 6 loss tokens in mini-batches of 2 rows: 3 and 9 tokens of their own, 12 / 2 = 6 each switched
    batch = TrainBatch.from_sequences([[5, 6]] * 4, [[7] * n for n in (1, 2, 3, 6)], [[1] * n for n in (1, 2, 3, 6)])
    batch = batch.with_fields(old_log_probs=torch.zeros(batch.input_ids.shape),
                              advantages=torch.ones(batch.input_ids.shape))
    actor = actor_module.TorchActor(tiny_model("qwen2"), AlgorithmConfig(), OptimConfig(), mini_batch_samples=2,
                                    micro_batch_samples=1)
    actor.update_actor(batch)
    assert seen == [6.0, 6.0, 6.0, 6.0]  # each micro-batch of both mini-batches


def test_steps_alike_counts_the_first_steps_that_logged_the_same_samples():
    trl = {"reward": [-0.609375, -0.65625, -0.65625, -0.951], "length": [14.09375, 13.7578125, 13.703, 15.05]}
    megarl = {"reward": [-0.6094, -0.6562, -0.6562, -0.96], "length": [14.0938, 13.7578, 13.703, 15.05]}
    assert steps_alike(megarl, trl) == 3  # step 4's reward differs by 0.009
    assert steps_alike({"reward": [-0.5], "length": [14.0]}, trl) == 0
    assert steps_alike({}, trl) == 0  # a record from before the curves were kept
