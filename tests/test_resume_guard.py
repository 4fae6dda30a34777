"""A resume with a config that changes what is learned is refused, naming the keys; the keys
that say where and how the run runs may change; `trainer.resume_changed_config` forces it."""

from __future__ import annotations

import logging

import pytest
import yaml

from megarl.checkpoint import read_meta
from megarl.config import load_config
from megarl.errors import RunInputError
from megarl.resume_guard import changed_keys, check_resume
from megarl.train import train
from train_fixtures import tiny_overrides, write_tiny_run_inputs


def test_the_keys_that_change_what_is_learned():
    saved = {"algorithm.clip_ratio_high": 0.28, "actor.optim.lr": 1e-6, "trainer.seed": 1, "cluster.nnodes": 2,
             "actor.parallel.tensor_model_parallel_size": 8, "trainer.total_training_steps": 100,
             "rollout.sglang.router_policy": "cache_aware", "data.train_files": ["a.parquet"]}
    now = dict(saved, **{"algorithm.clip_ratio_high": 0.3, "cluster.nnodes": 4,
                         "actor.parallel.tensor_model_parallel_size": 4, "trainer.total_training_steps": 200,
                         "rollout.sglang.router_policy": "round_robin", "data.train_files": ["b.parquet"]})
    del now["trainer.seed"]  # a key only one side has
    now["reward.custom_function"] = "pkg.mod:fn"
    assert changed_keys(saved, now) == ["algorithm.clip_ratio_high", "data.train_files", "reward.custom_function",
                                        "trainer.seed"]
    assert changed_keys(saved, dict(saved)) == []


def test_the_refusal_names_each_key_with_both_values_and_the_ways_on(tmp_path, caplog):
    with pytest.raises(RunInputError) as error:
        check_resume({"algorithm.n": 1, "trainer.seed": 1}, {"algorithm.n": 2}, tmp_path / "step_000002", False)
    assert str(error.value) == (
        f"the config changes what the run at {tmp_path / 'step_000002'} was learning:\n"
        "  algorithm.n: 1 -> 2\n  trainer.seed: 1 -> '(not set)'\n"
        "To continue it, run with its config; to start a new run, set another trainer.output_dir (or "
        "trainer.resume=disable); to resume with these changes anyway, set trainer.resume_changed_config=true.")
    with caplog.at_level(logging.INFO, logger="megarl.resume_guard"):
        check_resume({"algorithm.n": 1}, {"algorithm.n": 2}, tmp_path, True)
        check_resume(None, {"algorithm.n": 2}, tmp_path, False)
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
    assert "algorithm.n: 1 -> 2" in caplog.records[0].getMessage()
    assert "records no config" in caplog.records[1].getMessage()


def test_a_rerun_with_another_algorithm_is_refused_before_anything_starts(tmp_path):
    inputs = write_tiny_run_inputs(tmp_path / "inputs")
    out = tmp_path / "run"
    train(load_config(None, tiny_overrides(inputs, out, steps=1)))
    assert read_meta(out / "checkpoints" / "step_000001")["config"]["algorithm.clip_ratio_high"] == 0.28
    written = (out / "config.yaml").read_text()

    changed = tiny_overrides(inputs, out, steps=2) + ["algorithm.clip_ratio_high=0.3"]
    with pytest.raises(RunInputError, match=r"algorithm.clip_ratio_high: 0.28 -> 0.3\n"):
        train(load_config(None, changed))
    assert (out / "config.yaml").read_text() == written  # the refused run left the run's files alone

    train(load_config(None, changed + ["trainer.resume_changed_config=true"]))
    assert read_meta(out / "checkpoints" / "step_000002")["step"] == 2
    assert yaml.safe_load((out / "config.yaml").read_text())["algorithm"]["clip_ratio_high"] == 0.3
