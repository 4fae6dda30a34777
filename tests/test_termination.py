"""SIGTERM (slurm's scancel and time limit) and SIGINT stop `megarl train` like Ctrl-C (issue 17):
exit status 128 + signal within a bounded time, the MLflow run KILLED with the signal in the tag
megarl.stop_signal, the newest checkpoint whole, no process of the run left (psutil over the
process tree recorded before the signal); a rerun resumes from the checkpoint in the same MLflow
run, and a run stopped before its first checkpoint is continued, not duplicated. The runs are
subprocesses, signalled while a step is under way (the reward notes each call in a file and
takes its time); every process is found and stopped by its own id."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from megarl import termination
from megarl.checkpoint import list_checkpoints, verify
from megarl.config import TrackingConfig, load_config
from megarl.tracking import STOP_SIGNAL_TAG, local_store_uri, open_tracker
from megarl.train import train
from train_fixtures import tiny_overrides, write_tiny_run_inputs

TESTS = Path(__file__).resolve().parent
STEP_CALLS = 8  # reward calls per step: data.train_batch_size 2 x rollout.n 4
SLOW = ["trainer.val_before_train=false", "trainer.test_freq=0", "reward.num_workers=1",
        "reward.custom_function=slow_reward:noted_slow_score"]


def to_this_thread(signum: int) -> None:
    """The signal sent to the calling (main) thread itself, as the kernel gives a process-directed
    one to a main thread that does not block it. A process-directed one (os.kill) may be taken by
    any thread left running by an earlier test on the same worker, and reach Python late."""
    signal.pthread_kill(threading.get_ident(), signum)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("inputs"))


class Run:
    """`megarl train` as a subprocess whose reward calls are noted in `reward_log`."""

    def __init__(self, tmp_path: Path, overrides: list[str], sleep_s: float):
        self.reward_log, self.output = tmp_path / "reward.log", tmp_path / "train.log"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
                   MEGARL_TEST_REWARD_LOG=str(self.reward_log), MEGARL_TEST_REWARD_SLEEP=str(sleep_s))
        with open(self.output, "w") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "megarl.cli", "train", *overrides], env=env,
                                            stdout=out, stderr=subprocess.STDOUT)
        self.tree: list[psutil.Process] = []

    def reward_calls(self) -> int:
        return len(self.reward_log.read_text().splitlines()) if self.reward_log.exists() else 0

    def wait_until(self, condition, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert self.process.poll() is None, f"the run exited ({self.process.returncode}) before {what}:\n{self.log()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s:\n{self.log()}"
            time.sleep(0.05)

    def signal(self, signum: int) -> None:
        """Record the run's process tree, then signal the driver alone."""
        self.tree = [psutil.Process(self.process.pid), *psutil.Process(self.process.pid).children(recursive=True)]
        self.commands = {p.pid: _command(p) for p in self.tree}
        os.kill(self.process.pid, signum)

    def log(self) -> str:
        return self.output.read_text()[-4000:]

    def left(self, within_s: float) -> list[str]:
        """The recorded processes still alive after within_s (a zombie counts as gone)."""
        deadline = time.monotonic() + within_s
        while (alive := [p for p in self.tree if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        return [f"{p.pid} {self.commands[p.pid]}" for p in alive if _alive(p)]

    def stop(self) -> None:
        """Whatever is still running after the test: killed by its own id."""
        for p in [psutil.Process(self.process.pid)] if self.process.poll() is None else []:
            p.kill()
        for p in self.tree:
            if _alive(p):
                p.kill()
        self.process.wait(timeout=30)


def _command(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:200]
    except psutil.Error:
        return "?"


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def only_run(out: Path):
    client = MlflowClient(tracking_uri=local_store_uri(out))
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    return client, run


def metric_steps(client, run, name: str = "train/reward_mean") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, name))


def signal_masks(pid: int) -> str:
    """The process's signal masks (blocked, ignored, caught) as the kernel reports them."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return ", ".join(line for line in lines if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


def stopped(run: Run, signum: int, limit_s: float) -> float:
    """Signal the run; its exit status must be 128 + signum within limit_s. The seconds it took."""
    started = time.monotonic()
    masks = signal_masks(run.process.pid)  # a signal ignored or blocked where it was sent says why
    run.signal(signum)
    try:
        status = run.process.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{signal.Signals(signum).name}: the run did not exit within {limit_s} s ({masks}):\n{run.log()}")
    assert status == 128 + signum, run.log()
    assert f"megarl: stopped by {signal.Signals(signum).name}" in run.log()
    return time.monotonic() - started


@pytest.mark.timeout(300)
def test_sigterm_mid_step_stops_cleanly_and_the_rerun_resumes_in_the_same_mlflow_run(inputs, tmp_path, capsys):
    out = tmp_path / "run"
    overrides = tiny_overrides(inputs, out, steps=3) + SLOW
    run = Run(tmp_path, overrides, sleep_s=0.5)
    try:
        step1 = out / "checkpoints" / "step_000001"
        # step 1 saved and step 2's rewards begun: signalled in the middle of step 2 (its 8 calls take 4 s)
        run.wait_until(lambda: (step1 / "meta.json").exists() and run.reward_calls() > STEP_CALLS, 240, "step 2")
        stopped(run, signal.SIGTERM, limit_s=60)
        assert run.left(within_s=20) == []
    finally:
        run.stop()
    assert f"the newest checkpoint is step 1 ({step1}): the same command resumes from it" in run.log()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000001"]  # no partial step 2
    verify(step1)
    client, first = only_run(out)
    assert first.info.status == "KILLED" and first.data.tags[STOP_SIGNAL_TAG] == "SIGTERM"
    assert metric_steps(client, first) == [1]

    capsys.readouterr()
    train(load_config(None, overrides))  # the same command again, in this process
    assert f"megarl: resumed from {step1} (step 1)" in capsys.readouterr().err
    client, again = only_run(out)
    assert again.info.run_id == first.info.run_id
    assert again.info.status == "FINISHED" and STOP_SIGNAL_TAG not in again.data.tags
    assert metric_steps(client, again) == [1, 2, 3]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.full)])
def test_stopped_before_the_first_checkpoint_the_rerun_continues_the_same_mlflow_run(inputs, tmp_path, signum):
    out = tmp_path / "run"
    overrides = tiny_overrides(inputs, out, steps=1) + SLOW
    run = Run(tmp_path, overrides, sleep_s=0.5)
    try:
        run.wait_until(lambda: run.reward_calls() > 0, 240, "step 1's rewards")
        stopped(run, signum, limit_s=60)
        assert run.left(within_s=20) == []
    finally:
        run.stop()
    assert list_checkpoints(out / "checkpoints") == []
    client, first = only_run(out)
    assert first.info.status == "KILLED" and first.data.tags[STOP_SIGNAL_TAG] == signal.Signals(signum).name
    assert metric_steps(client, first) == []

    train(load_config(None, overrides))
    client, again = only_run(out)  # one run: the stopped one, finished
    assert again.info.run_id == first.info.run_id and again.info.status == "FINISHED"
    assert metric_steps(client, again) == [1]


def ray_run_in_step_2(inputs, tmp_path: Path) -> tuple[Run, Path]:
    out = tmp_path / "run"
    overrides = tiny_overrides(inputs, out, steps=3) + SLOW + ["cluster.launcher=ray", "cluster.cpus_per_node=3"]
    run = Run(tmp_path, overrides, sleep_s=0.5)
    run.wait_until(lambda: (out / "checkpoints" / "step_000001" / "meta.json").exists()
                   and run.reward_calls() > STEP_CALLS, 300, "step 2")
    return run, out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ray_launcher_sigterm_mid_step_stops_every_actor(inputs, tmp_path):
    run, out = None, tmp_path / "run"
    try:
        run, out = ray_run_in_step_2(inputs, tmp_path)
        stopped(run, signal.SIGTERM, limit_s=90)
        commands = " ".join(run.commands.values())
        assert all(f"ray::{a}" in commands for a in ("TrainWorkerActor", "EngineActor", "RewardActor")), commands
        assert run.left(within_s=30) == []  # Ray's own processes, the actors and the reward worker
    finally:
        if run is not None:
            run.stop()
    client, first = killed_by_sigterm_after_step_1(out)
    assert metric_steps(client, first) == [1]


def killed_by_sigterm_after_step_1(out):
    """(MLflow client, the run) once checked: step 1's checkpoint whole, the one run KILLED by SIGTERM."""
    verify(out / "checkpoints" / "step_000001")
    client, first = only_run(out)
    assert first.info.status == "KILLED" and first.data.tags[STOP_SIGNAL_TAG] == "SIGTERM"
    return client, first


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.timeout(400)
def test_a_second_sigterm_cuts_a_slow_shutdown_short_and_leaves_no_process(inputs, tmp_path):
    run, out = None, tmp_path / "run"
    try:
        run, out = ray_run_in_step_2(inputs, tmp_path)
        tree = psutil.Process(run.process.pid).children(recursive=True)
        engine = [p for p in tree if "ray::EngineActor" in _command(p)]
        assert len(engine) == 1, [_command(p) for p in tree]
        os.kill(engine[0].pid, signal.SIGSTOP)  # frozen: the shutdown waits up to 30 s to close it
        run.signal(signal.SIGTERM)
        time.sleep(termination.REPEAT_WINDOW_S + 1)  # closer than that, it would count as the same request
        assert run.process.poll() is None, "the first SIGTERM did not wait for the frozen engine's close"
        started = time.monotonic()
        os.kill(run.process.pid, signal.SIGTERM)
        assert run.process.wait(timeout=25) == 143, run.log()
        assert time.monotonic() - started < 25  # well before the engine's 30 s close deadline
        assert run.left(within_s=20) == []
        assert "SIGTERM during the shutdown: killing the run's remaining processes now" in run.log()
    finally:
        if run is not None:
            run.stop()
    killed_by_sigterm_after_step_1(out)


# A run left RUNNING (its process SIGKILLed, no chance to close it) or stopped, then a start from
# step 0 in the same output directory: (its status, the rerun's params the same, trainer.resume
# auto) -> (the rerun reopens it, its status afterwards when not reopened)
RERUNS = [
    ("RUNNING", True, True, True, None),
    ("KILLED", True, True, True, None),
    ("FAILED", True, True, True, None),
    ("RUNNING", False, True, False, "KILLED"),  # another config: a new run, the orphan closed
    ("FAILED", False, True, False, "FAILED"),
    ("FINISHED", True, True, False, "FINISHED"),  # a finished run is not started over
    ("RUNNING", True, False, False, "KILLED"),  # trainer.resume=disable: always a new run
]


@pytest.mark.parametrize("status, same, auto, reopened, left", RERUNS)
def test_a_start_from_step_0_reopens_the_unfinished_run_of_the_same_config(tmp_path, status, same, auto, reopened,
                                                                           left):
    cfg, params = TrackingConfig(experiment_name="t"), {"rollout.n": 4, "data.train_files": ["a.parquet"]}
    first = open_tracker(cfg, tmp_path, rerun_params=params)
    first.log_params(params)
    if status != "RUNNING":
        first.close(status, stop_signal="SIGTERM" if status == "KILLED" else None)
    changed = params if same else params | {"rollout.n": 8}
    again = open_tracker(cfg, tmp_path, rerun_params=changed if auto else None)
    client = MlflowClient(tracking_uri=local_store_uri(tmp_path))
    assert (again.run_id == first.run_id) is reopened
    if reopened:
        run = client.get_run(first.run_id)
        assert run.info.status == "RUNNING" and STOP_SIGNAL_TAG not in run.data.tags
    else:
        assert client.get_run(first.run_id).info.status == left
        assert client.get_run(again.run_id).info.status == "RUNNING"


def test_a_first_signal_waits_for_a_deferred_block_and_a_second_raises_at_once():
    events, before = [], signal.getsignal(signal.SIGTERM)

    @termination.stop_on_signals
    def run():
        with termination.deferred():  # a checkpoint being written
            to_this_thread(signal.SIGTERM)
            events.append("the block went on")
        events.append("not reached")

    with pytest.raises(termination.Stopped) as stopped_by:
        run()
    assert events == ["the block went on"] and stopped_by.value.signum == signal.SIGTERM

    @termination.stop_on_signals
    def insisted():
        with termination.deferred():
            to_this_thread(signal.SIGINT)
            to_this_thread(signal.SIGINT)  # the second
            events.append("not reached")

    with pytest.raises(termination.Stopped) as stopped_by:
        insisted()
    assert stopped_by.value.signum == signal.SIGINT and events == ["the block went on"]
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers from before the run are back


def test_a_checkpoint_failing_after_the_first_signal_is_the_stop_and_without_one_the_failure(caplog):
    # a preemption signals Ray's processes too: the checkpoint's writers die while the driver
    # holds the signal, and the save fails; the run is stopped (and requeued), not failed
    @termination.stop_on_signals
    def preempted():
        with termination.deferred():
            to_this_thread(signal.SIGTERM)
            raise BrokenPipeError("the writer's queue is gone")

    with pytest.raises(termination.Stopped) as stopped_by:
        preempted()
    assert stopped_by.value.signum == signal.SIGTERM
    assert "SIGTERM came while a checkpoint was being written" in caplog.text
    assert "BrokenPipeError: the writer's queue is gone" in caplog.text

    @termination.stop_on_signals
    def failed():
        with termination.deferred():
            raise BrokenPipeError("a full disk, say")

    with pytest.raises(BrokenPipeError):
        failed()


@pytest.mark.timeout(300)
def test_a_preemption_that_breaks_the_checkpoint_being_written_stops_the_run_at_the_one_before(
        inputs, tmp_path, monkeypatch, capsys):
    # slurm's SIGTERM reaches the driver and the checkpoint's writers at once: the writers die,
    # the save of step 2 fails after the driver noted the signal
    from megarl.backends.torch.worker import TorchTrainWorker

    whole = TorchTrainWorker.save_checkpoint

    def preempted_at_step_2(self, directory):
        if Path(directory).name.startswith(".tmp-step_000002"):
            to_this_thread(signal.SIGTERM)
            raise BrokenPipeError("[Errno 32] Broken pipe")
        whole(self, directory)

    monkeypatch.setattr(TorchTrainWorker, "save_checkpoint", preempted_at_step_2)
    out = tmp_path / "run"
    with pytest.raises(termination.Stopped) as stopped_by:
        train(load_config(None, tiny_overrides(inputs, out, steps=3) + ["trainer.test_freq=0"]))
    assert stopped_by.value.signum == signal.SIGTERM
    step1 = out / "checkpoints" / "step_000001"
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000001"]  # step 2's partial one removed
    verify(step1)
    assert "megarl: run killed" in capsys.readouterr().out  # the CLI then names the newest checkpoint: step 1
    client, run = only_run(out)
    assert run.info.status == "KILLED" and run.data.tags[STOP_SIGNAL_TAG] == "SIGTERM"


def test_a_run_takes_its_signals_even_when_started_with_them_blocked():
    """Ray starts processes with SIGINT blocked: a run still stops on it, and the mask it was
    started with is back afterwards."""
    @termination.stop_on_signals
    def run():
        to_this_thread(signal.SIGINT)
        time.sleep(5)  # not reached: the signal is taken at once

    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        started = time.monotonic()
        with pytest.raises(termination.Stopped) as stopped_by:
            run()
        assert stopped_by.value.signum == signal.SIGINT and time.monotonic() - started < 2
        assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the mask it had
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def test_a_repeated_sigterm_is_one_request_and_a_later_one_cuts_the_cleanup_short(monkeypatch):
    killed = []
    monkeypatch.setattr(termination, "kill_descendants", lambda: killed.append(True) or [])
    monkeypatch.setattr(termination, "REPEAT_WINDOW_S", 0.5)
    events = []

    @termination.stop_on_signals
    def run():
        try:
            to_this_thread(signal.SIGTERM)
            events.append("not reached")
        finally:
            with termination.closing():
                to_this_thread(signal.SIGTERM)  # slurm's and ray_on_slurm's: the same request
                events.append("cleanup went on")
                time.sleep(0.6)
                to_this_thread(signal.SIGTERM)  # a second request: the rest is cut short
                events.append("not reached")
            events.append("after the cleanup")

    with pytest.raises(termination.Stopped):
        run()
    assert events == ["cleanup went on", "after the cleanup"] and killed == [True]


def test_a_handler_installed_during_the_run_gives_way_to_the_runs_own_and_none_after_it():
    before = signal.getsignal(signal.SIGTERM)

    @termination.stop_on_signals
    def run():
        with termination.handlers_kept():  # as around ray.init, which makes SIGTERM sys.exit(15)
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        return signal.getsignal(signal.SIGTERM)

    assert run() is termination._on_signal
    assert signal.getsignal(signal.SIGTERM) is before
    with termination.handlers_kept():  # outside a run: whatever the call sets stays
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    signal.signal(signal.SIGTERM, before)
