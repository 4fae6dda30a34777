#!/usr/bin/env bash
# `make test-multinode` (also run by .ci/run): megarl's recipes on a simulated slurm cluster of
# several nodes on this machine (tests/multinode/cluster.sh: network namespaces on a private
# bridge, a hostname and a slurmd each, one slurmctld). Needs root; without it, exits 2.
#
# The runs (each short; the quickstart inputs are prepared once and shared), each submitted from
# node1 with sbatch, the CPU quickstart recipe (examples/quickstart/run_quickstart.sh) through
# tools/ray_on_slurm.sh: the Ray head on node1, a Ray worker on node2, the driver on node1:
#   1. the engine fleet (embedded servers behind sglang-router) and the trainer on different
#      nodes, weights synced between hosts over the update group (nccl transport, gloo on CPU)
#      and, in a second run, through a directory both nodes see (disk), with sync.verify=true;
#      the retrieval server searched from trajectories driven on the driver's node; each ending
#      bit for bit on the weights of the same run on one node;
#   2. the megatron backend with two ranks (DP = 2) on two nodes, torch.distributed over gloo
#      between the nodes' addresses, ending bit for bit on the weights of the same run on one node;
#   3. the same at PP = 2: one pipeline stage on each node.
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

export DATA_DIR=$WORK/data MEGARL_PYTHON=$PY RAY_PORT=6379
SHORT=(trainer.total_training_steps=2 trainer.test_freq=2 trainer.save_freq=2 algorithm.dynamic_sampling.enable=false
       data.train_batch_size=8 data.gen_batch_size=8)
SPREAD=(cluster.placement_strategy=SPREAD)

# run NAME NODES ARGS...: the quickstart recipe on NODES nodes, output in $WORK/NAME
run() {
    local name=$1 nodes=$2; shift 2
    OUTPUT_DIR=$WORK/$name MLFLOW_TRACKING_URI=sqlite:///$WORK/$name.db \
        sbatch_on_cluster "$name" --nodes="$nodes" examples/quickstart/run_quickstart.sh "${SHORT[@]}" "$@"
}

# --- 1. the engine fleet on another node than the trainer ------------------------------------
FLEET=(rollout.engine=sglang rollout.sglang.server=embedded sync.verify=true)
run fleet_one 1 "${FLEET[@]}" sync.transport=disk
run fleet_nccl 2 "${FLEET[@]}" sync.transport=nccl "${SPREAD[@]}"
run fleet_disk 2 "${FLEET[@]}" sync.transport=disk "${SPREAD[@]}"
for name in fleet_nccl fleet_disk; do
    grep -q "Ray is up on 2 node(s)" "$WORK/$name.out"
    placed=$(grep -a "megarl placement:" "$WORK/$name.out")
    [[ $placed =~ "train ranks on "([0-9.]+)";".*"rollout engines on "([0-9.]+) && ${BASH_REMATCH[1]} != "${BASH_REMATCH[2]}" ]] \
        || { echo "test-multinode: $name: the trainer and the engines are not on different nodes: $placed" >&2; exit 1; }
    "$PY" tests/multinode/check_run.py "sqlite:///$WORK/$name.db" "$WORK/$name.out" --steps 2 \
        --nodes "$(node_addr 1),$(node_addr 2)"
    "$PY" tests/multinode/same_weights.py "$WORK/fleet_one/hf" "$WORK/$name/hf" "$WORK/data/model"
done

# megatron_across_nodes NAME ARGS...: the megatron backend with two ranks, on one node (NAME_one)
# and with one rank on each node (NAME_two); the two-node run ends on the one-node run's weights
megatron_across_nodes() {
    local name=$1; shift
    run "${name}_one" 1 actor.backend=megatron "$@"
    run "${name}_two" 2 actor.backend=megatron "$@" "${SPREAD[@]}"
    grep -q "megarl placement: train ranks on $(node_addr 1), $(node_addr 2);" "$WORK/${name}_two.out" \
        || { grep "megarl placement" "$WORK/${name}_two.out" >&2
             echo "test-multinode: ${name}_two: the two ranks are not on two nodes" >&2; exit 1; }
    "$PY" tests/multinode/check_run.py "sqlite:///$WORK/${name}_two.db" "$WORK/${name}_two.out" --steps 2
    "$PY" tests/multinode/same_weights.py "$WORK/${name}_one/hf" "$WORK/${name}_two/hf" "$WORK/data/model"
}

# --- 2. two ranks (DP = 2) on two nodes, gloo between the nodes' addresses
megatron_across_nodes dp2 actor.parallel.data_parallel_size=2
# --- 3. PP = 2: one pipeline stage on each node
megatron_across_nodes pp2 actor.parallel.pipeline_model_parallel_size=2

echo "test-multinode: passed in $((SECONDS - started)) s"
