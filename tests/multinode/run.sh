#!/usr/bin/env bash
# `make test-multinode` (also run by .ci/run): megarl's recipes on a simulated slurm cluster of
# several nodes on this machine (tests/multinode/cluster.sh: network namespaces on a private
# bridge, a hostname and a slurmd each, one slurmctld). Needs root; without it, exits 2.
#
# The runs (each short; the quickstart inputs are prepared once and shared):
#   1. the CPU quickstart recipe submitted with sbatch --nodes=2: the Ray head on node1, a Ray
#      worker on node2, the driver on node1; actors placed on both nodes; the run completes and
#      MLflow has its metrics;
#   2. the megatron backend with two ranks (DP = 2) on two nodes, torch.distributed over gloo
#      between the nodes' addresses, ending bit for bit on the weights of the same run on one node.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${MEGARL_PYTHON:-$REPO/.venv/bin/python}
NODES=${MULTINODE_NODES:-2}
source tests/multinode/cluster.sh

cluster_up "$NODES" || exit $?
WORK=$CLUSTER_DIR
started=$SECONDS

# the quickstart's inputs once, for every run (a 20-step warm-up: the runs check the pipeline
# across nodes, not learning)
"$PY" -m megarl.quickstart prepare "$WORK/data" --warmup-steps 20 > "$WORK/prepare.log" 2>&1 \
    || { tail -n 30 "$WORK/prepare.log" >&2; exit 1; }

# sbatch_on_cluster NAME ARGS...: submit from node1 and wait; the job's output is $WORK/NAME.out
sbatch_on_cluster() {
    local name=$1; shift
    local status=0
    on_node 1 timeout 900 sbatch --wait --job-name="$name" --output="$WORK/$name.out" --chdir="$REPO" "$@" \
        > "$WORK/$name.sbatch" || status=$?
    local job
    job=$(awk '/Submitted batch job/ {print $4}' "$WORK/$name.sbatch")
    local state
    state=$(on_node 1 scontrol show job "$job" | grep -o 'JobState=[A-Z]*' || true)
    echo "test-multinode: $name: job $job ended with status $status ($state) after $((SECONDS - started)) s"
    if [[ $status -ne 0 || $state != "JobState=COMPLETED" ]]; then
        echo "--- the end of $WORK/$name.out" >&2
        tail -n 60 "$WORK/$name.out" >&2
        return 1
    fi
}

# --- 1. the quickstart recipe on two nodes ---------------------------------------------------
export DATA_DIR=$WORK/data MEGARL_PYTHON=$PY RAY_PORT=6379
OUTPUT_DIR=$WORK/quickstart MLFLOW_TRACKING_URI=sqlite:///$WORK/quickstart.db \
    sbatch_on_cluster quickstart --nodes=2 examples/quickstart/run_quickstart.sh trainer.total_training_steps=2 \
    trainer.test_freq=1 algorithm.dynamic_sampling.enable=false data.train_batch_size=8 data.gen_batch_size=8 \
    cluster.placement_strategy=SPREAD
grep -q "Ray is up on 2 node(s)" "$WORK/quickstart.out"
grep -q "megarl: run finished" "$WORK/quickstart.out"
"$PY" tests/multinode/check_run.py "sqlite:///$WORK/quickstart.db" "$WORK/quickstart.out" \
    --steps 2 --nodes "$(node_addr 1),$(node_addr 2)"

# --- 2. the megatron backend: two ranks (DP = 2) on two nodes, gloo between the nodes' addresses,
# ending on the weights of the same run on one node
MEGATRON=(actor.backend=megatron actor.parallel.data_parallel_size=2 trainer.total_training_steps=2
          trainer.test_freq=2 trainer.save_freq=2 algorithm.dynamic_sampling.enable=false
          data.train_batch_size=8 data.gen_batch_size=8)
OUTPUT_DIR=$WORK/dp2_one MLFLOW_TRACKING_URI=sqlite:///$WORK/dp2_one.db \
    sbatch_on_cluster dp2_one --nodes=1 examples/quickstart/run_quickstart.sh "${MEGATRON[@]}"
OUTPUT_DIR=$WORK/dp2_two MLFLOW_TRACKING_URI=sqlite:///$WORK/dp2_two.db \
    sbatch_on_cluster dp2_two --nodes=2 examples/quickstart/run_quickstart.sh "${MEGATRON[@]}" \
    cluster.placement_strategy=SPREAD
grep -q "megarl placement: train ranks on $(node_addr 1), $(node_addr 2);" "$WORK/dp2_two.out" \
    || { grep "megarl placement" "$WORK/dp2_two.out" >&2; echo "test-multinode: the two ranks are not on two nodes" >&2; exit 1; }
"$PY" tests/multinode/check_run.py "sqlite:///$WORK/dp2_two.db" "$WORK/dp2_two.out" --steps 2
"$PY" tests/multinode/same_weights.py "$WORK/dp2_one/hf" "$WORK/dp2_two/hf" "$WORK/data/model"

echo "test-multinode: passed in $((SECONDS - started)) s"
