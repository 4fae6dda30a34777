"""tools/ray_on_slurm.sh and signals, on stand-ins for slurm (srun, scontrol), Ray (`ray start
--block`) and the driver: a SIGTERM to the batch shell alone (`scancel --batch --signal=TERM`,
`#SBATCH --signal=B:TERM@300`) reaches the driver at once although bash runs traps only after a
foreground command, the driver's exit status is the job's, and Ray is stopped after the driver
has exited (its cleanup still reaches the actors). The real slurm path is `make test-slurm`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]

SRUN = """#!/usr/bin/env bash
# srun [options] command: runs the command here
while [[ $# -gt 0 && $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
# scontrol show hostnames | show job (the job's record from $SCONTROL_JOB) | requeue (noted)
case "$1 $2" in
    "show hostnames") echo localhost ;;
    "show job") echo "${SCONTROL_JOB:-JobId=1 JobState=RUNNING Requeue=1 PreemptTime=None EndTime=Unknown}" ;;
    requeue*) echo "requeue $2 $(date +%s.%N)" >> "$EVENTS" ;;
esac
"""
PYTHON = """#!/usr/bin/env bash
# the python ray_on_slurm asks for the node address, a token, and whether Ray sees every node
case "$*" in
    *get_node_ip_address*) echo 127.0.0.1 ;;
    *secrets*) echo token ;;
    -*) cat > /dev/null ;;
esac
"""
RAY = """#!/usr/bin/env bash
# ray start --block: until SIGTERM, as Ray's own stops its node's processes then, once: a second
# SIGTERM while stopping (slurm signals the whole step, and the relay passes one on) is not a second stop
trap 'trap "" TERM; echo "ray stopped $(date +%s.%N)" >> "$EVENTS"; exit 0' TERM
echo "ray started $(date +%s.%N)" >> "$EVENTS"
while true; do sleep 0.1; done
"""
DRIVER = """import os, signal, sys, time
events, stop = sys.argv[1], []
with open(events + ".end", "w") as fh:  # the job's end as megarl would read it
    fh.write(os.environ.get("MEGARL_JOB_END_TIME", ""))
def note(line):
    with open(events, "a") as fh:
        fh.write(f"{line} {time.time():.3f}\\n")
signal.signal(signal.SIGTERM, lambda s, f: (note("driver got SIGTERM"), stop.append(s)))
note("driver started")
deadline = time.time() + float(sys.argv[2])
while not stop and time.time() < deadline:
    time.sleep(0.05)
time.sleep(1.0)  # its cleanup, while Ray is still up
note("driver exited")
sys.exit(int(sys.argv[3]) if stop else int(os.environ.get("DRIVER_STATUS", "0")))  # 143 when it stopped cleanly; 1 when it failed while stopping
"""


def start(tmp_path: Path, run_s: float, job: str | None = None, status_on_stop: int = 143, **extra_env: str
          ) -> tuple[subprocess.Popen, Path]:
    """The shell running ray_on_slurm with the stand-ins; its output goes to tmp_path/output."""
    bin_dir, events = tmp_path / "bin", tmp_path / "events"
    bin_dir.mkdir()
    for name, text in {"srun": SRUN, "scontrol": SCONTROL, "python": PYTHON, "ray": RAY}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="1", SLURM_JOB_NODELIST="localhost",
               MEGARL_PYTHON=str(bin_dir / "python"), EVENTS=str(events), MEGARL_RAY_STOP_TIMEOUT="10", **extra_env)
    if job is not None:  # what `scontrol show job` says of the job
        env["SCONTROL_JOB"] = job
    script = (f"set -euo pipefail; source {ROOT / 'tools' / 'ray_on_slurm.sh'}; "  # as the recipes run it
              f"ray_on_slurm {sys.executable} {tmp_path / 'driver.py'} {events} {run_s} {status_on_stop}")
    with open(tmp_path / "output", "w") as output:
        shell = subprocess.Popen(["bash", "-c", script], env=env, stdout=output, stderr=subprocess.STDOUT)
    return shell, events


def stop(shell: subprocess.Popen, tree: list[psutil.Process]) -> None:
    """The shell and what it started (recorded in tree while it ran), if still running after a
    failed case: killed by their own ids."""
    for process in [*tree, psutil.Process(shell.pid)] if shell.poll() is None else tree:
        if process.is_running():
            process.kill()
    shell.wait(timeout=10)


def lines(events: Path) -> list[str]:
    """The events in order, without their times."""
    return [line.rsplit(" ", 1)[0] for line in events.read_text().splitlines()] if events.exists() else []


def driver_started(shell: subprocess.Popen, events: Path, tmp_path: Path) -> list[psutil.Process]:
    """Once the driver has started (within 20 s): what the shell has started by then."""
    deadline = time.monotonic() + 20
    while "driver started" not in lines(events):
        assert time.monotonic() < deadline and shell.poll() is None, (tmp_path / "output").read_text()
        time.sleep(0.05)
    return psutil.Process(shell.pid).children(recursive=True)


def command_line(process: psutil.Process) -> str:
    """Its command line; "" once it has exited (a zombie has none)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def at(events: Path, what: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in events.read_text().splitlines() if line.startswith(what))


def sigterm_to_the_batch_shell(tmp_path: Path, job: str | None = None, status_on_stop: int = 143
                               ) -> tuple[int, Path, str]:
    """A run whose batch shell alone gets SIGTERM once the driver runs: (its exit status, the
    events file, its output)."""
    shell, events = start(tmp_path, run_s=30, job=job, status_on_stop=status_on_stop)
    tree = []
    try:
        tree = driver_started(shell, events, tmp_path)
        os.kill(shell.pid, signal.SIGTERM)
        status = shell.wait(timeout=20)
        time.sleep(0.5)  # a command or Ray left running would note itself by now
    finally:
        stop(shell, tree)
    return status, events, (tmp_path / "output").read_text()


@pytest.mark.timeout(60)
def test_a_sigterm_to_the_batch_shell_reaches_the_driver_now_and_ray_stops_after_it(tmp_path):
    status, events, output = sigterm_to_the_batch_shell(tmp_path)
    assert status == 143, output
    assert lines(events) == ["ray started", "driver started", "driver got SIGTERM", "driver exited", "ray stopped"]
    assert at(events, "driver got SIGTERM") - at(events, "driver started") < 5  # not after the driver's own end
    assert "SIGTERM: passing SIGTERM to the command" in output


@pytest.mark.timeout(60)
def test_a_driver_that_ends_by_itself_gives_its_status_and_ray_is_stopped(tmp_path):
    shell, events = start(tmp_path, run_s=0.5)
    try:
        status = shell.wait(timeout=30)
    finally:
        stop(shell, [])
    assert status == 0
    assert lines(events) == ["ray started", "driver started", "driver exited", "ray stopped"]


@pytest.mark.parametrize("requeue", [1, 0])
@pytest.mark.timeout(60)
def test_a_run_that_saved_before_the_jobs_end_knew_the_end_and_is_requeued(tmp_path, requeue):
    """The driver is told the job's end (MEGARL_JOB_END_TIME, from slurm's EndTime); megarl's
    exit 75 (saved before it, megarl.job_time) is requeued however far the end still is."""
    end = time.time() + 7200
    job = f"JobState=RUNNING Requeue={requeue} PreemptTime=None EndTime={_in(7200)}"
    shell, events = start(tmp_path, run_s=0.5, job=job, DRIVER_STATUS="75")
    try:
        status = shell.wait(timeout=30)
    finally:
        stop(shell, [])
    output = (tmp_path / "output").read_text()
    assert status == 75, output
    assert abs(int(Path(f"{events}.end").read_text()) - end) <= 2  # EndTime has whole seconds
    if requeue:
        assert lines(events) == ["ray started", "driver started", "driver exited", "ray stopped", "requeue 1"]
        assert "megarl saved before the job's end: requeueing job 1; it resumes from its newest checkpoint" in output
    else:
        assert "requeue 1" not in lines(events)
        assert "megarl saved before the job's end; not requeued: the job was submitted without --requeue" in output


@pytest.mark.timeout(60)
def test_a_sigterm_to_the_ray_head_step_reaches_the_driver_now(tmp_path):
    # a preemption in a partition with a GraceTime: slurm signals every process of the job's steps
    # (here the head's: the relay and `ray start`), and the batch shell only GraceTime seconds later
    shell, events = start(tmp_path, run_s=30)
    tree = []
    try:
        tree = driver_started(shell, events, tmp_path)
        step = [p for p in tree if "relay-term-to-batch-shell" in command_line(p)]
        assert len(step) == 1, [command_line(p) for p in tree]
        for process in [step[0], *step[0].children(recursive=True)]:
            process.send_signal(signal.SIGTERM)
        status = shell.wait(timeout=20)
    finally:
        stop(shell, tree)
    output = (tmp_path / "output").read_text()
    assert status == 143, output
    assert sorted(lines(events)) == sorted(["ray started", "driver started", "ray stopped", "driver got SIGTERM",
                                            "driver exited"])
    assert at(events, "driver got SIGTERM") - at(events, "driver started") < 5  # now, not at the driver's own end
    assert "SIGTERM: passing SIGTERM to the command" in output


def _in(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + seconds))


@pytest.mark.parametrize("job, requeued", [
    (f"JobState=RUNNING Requeue=1 PreemptTime={_in(0)} EndTime={_in(3000)}", "preempted at"),
    (f"JobState=RUNNING Requeue=1 PreemptTime=None EndTime={_in(290)}", "its time limit is"),
    (f"JobState=RUNNING Requeue=0 PreemptTime={_in(0)} EndTime={_in(3000)}", None),
    (f"JobState=RUNNING Requeue=1 PreemptTime=None EndTime={_in(3000)}", None),  # stopped by hand
], ids=["preempted", "time-limit", "preempted-without-requeue", "by-hand"])
@pytest.mark.timeout(60)
def test_a_run_stopped_because_slurm_takes_the_job_away_is_requeued(tmp_path, job, requeued):
    status, events, output = sigterm_to_the_batch_shell(tmp_path, job)
    assert status == 143, output
    if requeued:
        assert lines(events) == ["ray started", "driver started", "driver got SIGTERM", "driver exited", "ray stopped",
                                 "requeue 1"]
        assert f"{requeued}" in output and "requeueing job 1; it resumes from its newest checkpoint" in output
    else:
        assert "requeue 1" not in lines(events)
        assert ("not requeued: the job was submitted without --requeue" in output) == ("Requeue=0" in job)


@pytest.mark.parametrize("job, requeued", [
    (f"JobState=RUNNING Requeue=1 PreemptTime={_in(0)} EndTime={_in(3000)}", True),
    (f"JobState=RUNNING Requeue=1 PreemptTime=None EndTime={_in(290)}", False),  # a failure near the time limit
    (f"JobState=RUNNING Requeue=1 PreemptTime=None EndTime={_in(3000)}", False),
], ids=["preempted", "time-limit", "neither"])
@pytest.mark.timeout(60)
def test_a_run_that_fails_while_a_preemption_stops_it_is_requeued_and_another_failure_is_not(tmp_path, job, requeued):
    # a preemption signals Ray's processes with the driver: a part lost mid-checkpoint can fail
    # the run before its own SIGTERM is taken
    status, events, output = sigterm_to_the_batch_shell(tmp_path, job, status_on_stop=1)
    assert status == 1, output
    assert ("requeue 1" in lines(events)) is requeued, output
    if requeued:
        assert lines(events)[-2:] == ["ray stopped", "requeue 1"]
        assert re.search(r"the command failed \(status 1\) and the job was preempted at [0-9T:-]+: requeueing job 1; "
                         r"it resumes from its newest checkpoint", output), output
