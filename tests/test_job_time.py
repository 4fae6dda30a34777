"""Checkpoints on time (megarl.job_time): a run saves and stops before its job's end, where the
next step and a save would overrun it, and saves every trainer.save_interval_min minutes."""

from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from megarl.checkpoint import list_checkpoints, read_meta
from megarl.cli import main
from megarl.errors import RunInputError
from megarl.job_time import EXIT_JOB_TIME, SaveClock, job_end_time
from megarl.tracking import local_store_uri
from train_fixtures import tiny_overrides, write_tiny_run_inputs


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_the_next_step_and_a_save_must_end_before_the_margin():
    now = Clock()
    # the job ends at 1000 + 2000; margin 600: steps and saves must be over by 2400
    clock = SaveClock(end=3000.0, margin_s=600.0, interval_s=None, now=now)
    assert clock.time_up() is None  # no step timed yet: the first one runs
    clock.step_took(700.0)
    now.t = 1700.0  # 700 s left before the margin: 700 + a guessed 300 s save do not fit
    assert clock.time_up() == ("the job ends in 1300 s: a step (700 s, the longest of the last 1) and a save (300 s, "
                               "a guess) would end past its last 600 s (trainer.job_end_margin_s)")
    clock.saved(50.0)  # now timed: 700 + 50 = 750 > 700
    assert clock.time_up() is not None
    now.t = 1640.0  # 760 s left: 750 fits
    assert clock.time_up() is None
    for seconds in (100.0, 100.0):  # the longest of the last three is 700 s still
        clock.step_took(seconds)
    assert clock.time_up() is None and max(clock.steps_s) == 700.0
    clock.step_took(100.0)  # 700 s falls out of the last three
    now.t = 2240.0  # 160 s left: 100 + 50 fit; 100 + the guess would not have
    assert clock.time_up() is None


def test_no_end_known_never_stops_and_the_interval_counts_from_the_last_save():
    now = Clock()
    clock = SaveClock(end=None, margin_s=600.0, interval_s=60.0, now=now)
    clock.step_took(1e9)
    assert clock.time_up() is None
    now.t += 59.0
    assert not clock.interval_due()
    now.t += 1.0
    assert clock.interval_due()
    clock.saved(5.0)
    assert not clock.interval_due()


def test_the_end_is_read_from_the_environment():
    assert job_end_time({}) is None
    assert job_end_time({"SLURM_JOB_END_TIME": "1800000000"}) == 1.8e9
    assert job_end_time({"MEGARL_JOB_END_TIME": "1700000000", "SLURM_JOB_END_TIME": "1800000000"}) == 1.7e9
    for bad in ("tomorrow", "-5", "inf"):
        with pytest.raises(RunInputError, match=f"MEGARL_JOB_END_TIME='{bad}' is not a time in Unix seconds"):
            job_end_time({"MEGARL_JOB_END_TIME": bad})


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("inputs"))


@pytest.mark.slow
def test_a_run_near_its_jobs_end_saves_stops_and_its_rerun_ends_as_one_run(inputs, tmp_path, monkeypatch, capsys):
    """The job's end is 600 s away: whatever the first step takes, it and a save (300 s guessed)
    would not end before the margin, so the run saves step 1 and stops with exit 75; the rerun,
    without an end, resumes there. The weights and metrics are those of a run never stopped."""
    import time

    straight, split = tmp_path / "straight", tmp_path / "split"
    settings = ["trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false"]
    assert main(["train", *tiny_overrides(inputs, straight, steps=3), *settings]) == 0
    monkeypatch.setenv("MEGARL_JOB_END_TIME", str(time.time() + 600))
    assert main(["train", *tiny_overrides(inputs, split, steps=3), *settings, "trainer.job_end_margin_s=300"]) \
        == EXIT_JOB_TIME
    err = capsys.readouterr().err
    assert "megarl: saved at step 1 and stopped: the job ends in " in err
    assert [read_meta(p)["step"] for p in list_checkpoints(split / "checkpoints")] == [1]
    client = MlflowClient(tracking_uri=local_store_uri(split))
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert run.info.status == "KILLED"
    monkeypatch.delenv("MEGARL_JOB_END_TIME")
    assert main(["train", *tiny_overrides(inputs, split, steps=3), *settings]) == 0
    (resumed,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    a = load_file(str(straight / "checkpoints" / "step_000003" / "actor.safetensors"))
    b = load_file(str(split / "checkpoints" / "step_000003" / "actor.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_save_interval_min_saves_between_save_freqs(inputs, tmp_path):
    out = tmp_path / "run"
    # save_freq=0: only the last step saves, but for the interval (0.0001 min: every step)
    assert main(["train", *tiny_overrides(inputs, out, steps=2), "trainer.save_freq=0", "trainer.test_freq=0",
                 "trainer.val_before_train=false", "trainer.save_interval_min=0.0001", "trainer.max_ckpt_to_keep=5"]) == 0
    assert [read_meta(p)["step"] for p in list_checkpoints(out / "checkpoints")] == [1, 2]
    other = tmp_path / "other"
    assert main(["train", *tiny_overrides(inputs, other, steps=2), "trainer.save_freq=0", "trainer.test_freq=0",
                 "trainer.val_before_train=false", "trainer.max_ckpt_to_keep=5"]) == 0
    assert [read_meta(p)["step"] for p in list_checkpoints(other / "checkpoints")] == [2]
