#!/usr/bin/env bash
# A real slurm test (`make test-slurm`, also run by .ci/run): a one-node slurm cluster on this
# machine (munged, slurmctld and slurmd from Debian's slurm-wlm and munge, installed when
# missing), the CPU quickstart recipe submitted with sbatch and waited for, then checks that the
# job completed, that the run finished, and that MLflow has its metrics. The daemons it started
# are stopped by their pid files, whatever happens.
#
# The run is shortened (a 20-step warm-up, 2 training steps): it checks the pipeline on slurm
# (Ray on the allocation, the driver joining it, MLflow), not learning. A second job is stopped
# with `scancel --batch --signal=TERM` mid-step: exit code 143, MLflow KILLED, Ray stopped.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${MEGARL_PYTHON:-$REPO/.venv/bin/python}

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    if [[ $(id -u) -ne 0 ]]; then
        echo "test-slurm: slurm-wlm and munge are not installed; run as root or: apt-get install slurm-wlm munge" >&2
        exit 2
    fi
    echo "test-slurm: installing slurm-wlm and munge (Debian packages)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; }
fi

WORK=$(mktemp -d /tmp/megarl-slurm.XXXXXX)
mkdir -p "$WORK/state" "$WORK/spool" "$WORK/log"
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

cleanup() {
    local status=$?
    if [[ -n "${SLURM_CONF:-}" ]]; then  # a job still running ends first (slurm stops its processes)
        squeue -h -o %i 2>/dev/null | xargs -r scancel 2>/dev/null || true
        for _ in $(seq 30); do squeue -h 2>/dev/null | grep -q . || break; sleep 1; done
    fi
    local pids=() pid
    for daemon in slurmd slurmctld munged; do
        if [[ -f "$WORK/$daemon.pid" ]]; then
            pid=$(cat "$WORK/$daemon.pid")
            kill "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
    done
    for pid in "${pids[@]}"; do  # gone before their directory is (munged writes its seed file as it exits)
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    done
    if [[ $status -ne 0 ]]; then
        echo "test-slurm: FAILED; the ends of the logs:" >&2
        for f in "$WORK"/job.out "$WORK"/cancel.out "$WORK"/log/*.log; do
            [[ -f "$f" ]] && { echo "--- $f" >&2; tail -n 40 "$f" >&2; }
        done
    fi
    rm -rf "$WORK"
    exit $status
}
trap cleanup EXIT

dd if=/dev/urandom bs=1024 count=1 of="$WORK/munge.key" 2>/dev/null
chmod 600 "$WORK/munge.key"
munged --force --key-file="$WORK/munge.key" --socket="$WORK/munge.socket" --pid-file="$WORK/munged.pid" \
    --log-file="$WORK/log/munged.log" --seed-file="$WORK/munge.seed"

CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
cat > "$WORK/slurm.conf" <<CONF
ClusterName=megarltest
SlurmctldHost=localhost
SlurmUser=$(id -un)
SlurmdUser=$(id -un)
AuthType=auth/munge
AuthInfo=socket=$WORK/munge.socket
CredType=cred/munge
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.log
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName=localhost NodeHostname=$(hostname) NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=60 State=UP
CONF
export SLURM_CONF=$WORK/slurm.conf
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF" -N localhost
for _ in $(seq 60); do
    sinfo -h -o %t 2>/dev/null | grep -q idle && break
    sleep 1
done
sinfo -h -o %t | grep -q idle || { echo "test-slurm: the node did not come up" >&2; exit 1; }
echo "test-slurm: one-node slurm cluster up ($(sinfo -h -o '%P %D %c CPUs %t'))"

export MEGARL_DATA_DIR=$WORK/data MEGARL_OUTPUT_DIR=$WORK/run MLFLOW_TRACKING_URI=sqlite:///$WORK/mlflow.db
export MEGARL_PREPARE_ARGS="--warmup-steps 20" MEGARL_RAY_PORT=$(free_port)
export RAY_TMPDIR=$WORK/ray  # not /tmp/ray-<job id>: another test's cluster numbers its jobs from 1 too
start=$SECONDS
set +e
timeout 1500 sbatch --wait --job-name=megarl-slurm-test --output="$WORK/job.out" --chdir="$REPO" \
    examples/quickstart/run_quickstart.sh trainer.total_training_steps=2 trainer.test_freq=1 \
    algorithm.dynamic_sampling.enable=false data.train_batch_size=8 data.gen_batch_size=8 > "$WORK/sbatch.out"
status=$?
set -e
job=$(awk '/Submitted batch job/ {print $4}' "$WORK/sbatch.out")
echo "test-slurm: job $job ended with status $status after $((SECONDS - start)) s"
state=$(scontrol show job "$job" | grep -o 'JobState=[A-Z]*' || true)
[[ $status -eq 0 && $state == "JobState=COMPLETED" ]] || { echo "test-slurm: job $job: $state, status $status" >&2; exit 1; }
grep -q "megarl: run finished" "$WORK/job.out" || { echo "test-slurm: the run did not finish" >&2; exit 1; }
grep -q "Ray is up on 1 node" "$WORK/job.out"

"$PY" - "$MLFLOW_TRACKING_URI" <<'PYEOF'
import sys
from mlflow.tracking import MlflowClient

client = MlflowClient(tracking_uri=sys.argv[1])
runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
assert len(runs) == 1, f"expected one MLflow run, found {len(runs)}"
run = runs[0]
assert run.info.status == "FINISHED", run.info.status
steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/reward_mean"))
assert steps == [1, 2], steps
assert [m.step for m in client.get_metric_history(run.info.run_id, "val/acc")], "no val/acc"
print(f"test-slurm: MLflow run {run.info.run_id} FINISHED with train/reward_mean at steps {steps} and val/acc")
PYEOF

# Stopped by hand while a step is under way: scancel --batch --signal=TERM reaches the batch shell
# alone, tools/ray_on_slurm.sh passes it to the driver, which stops like Ctrl-C (exit 143), then
# stops Ray; the MLflow run is KILLED and the newest checkpoint whole.
export MEGARL_OUTPUT_DIR=$WORK/run_cancelled MLFLOW_TRACKING_URI=sqlite:///$WORK/mlflow_cancelled.db
job=$(sbatch --parsable --job-name=megarl-slurm-cancel --output="$WORK/cancel.out" --chdir="$REPO" \
    examples/quickstart/run_quickstart.sh trainer.total_training_steps=50 trainer.save_freq=1 trainer.test_freq=0 \
    trainer.val_before_train=false algorithm.dynamic_sampling.enable=false data.train_batch_size=8 \
    data.gen_batch_size=8)
for _ in $(seq 600); do  # until step 1 is saved: step 2 is under way
    [[ -f $MEGARL_OUTPUT_DIR/checkpoints/step_000001/meta.json ]] && break
    squeue -h -j "$job" | grep -q . || { echo "test-slurm: job $job ended before its first checkpoint" >&2; exit 1; }
    sleep 1
done
scancel --batch --signal=TERM "$job"
for _ in $(seq 180); do squeue -h -j "$job" | grep -q . || break; sleep 1; done
exit_code=$(scontrol show job "$job" | grep -o ' ExitCode=[0-9:]*' || true)
[[ $exit_code == " ExitCode=143:0" ]] || { echo "test-slurm: cancelled job $job:$exit_code, not 143:0" >&2; exit 1; }
grep -q "megarl: stopped by SIGTERM" "$WORK/cancel.out"
grep -q "command exited with status 143; stopping Ray" "$WORK/cancel.out"
"$PY" - "$MLFLOW_TRACKING_URI" "$MEGARL_OUTPUT_DIR" <<'PYEOF'
import sys
from mlflow.tracking import MlflowClient

from megarl.checkpoint import newest_intact

client = MlflowClient(tracking_uri=sys.argv[1])
(run,) = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
assert run.info.status == "KILLED" and run.data.tags["megarl.stop_signal"] == "SIGTERM", (run.info.status, run.data.tags)
newest = newest_intact(sys.argv[2] + "/checkpoints")  # verified
assert newest is not None, "no intact checkpoint"
print(f"test-slurm: the cancelled run is KILLED by SIGTERM in MLflow; newest checkpoint {newest.name}, intact")
PYEOF
echo "test-slurm: passed"
