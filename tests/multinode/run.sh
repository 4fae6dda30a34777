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
#      and, in a second run (part fleetdisk, not in the default), through a directory both nodes
#      see (disk), with sync.verify=true;
#      the retrieval server searched from trajectories driven on the driver's node; each ending
#      bit for bit on the weights of the same run in one process with the embedded engine (the
#      fleet's per-request seeds make a rollout independent of the engine that serves it; the
#      fleet on one node ends on those weights too, tests/test_fleet_train.py);
#   1b. one SGLang engine (SGLang 0.5.23's own server, `make sglang-env`) across the two nodes: TP 2,
#      one TP rank on each (--nnodes 2), launched as one unit, the weights through disk to both
#      ranks: the trainer's log-probs of the engine's samples match the engine's at every step;
#   2. the megatron backend with two ranks (DP = 2) on two nodes, torch.distributed over gloo
#      between the nodes' addresses, ending bit for bit on the weights of the same run on one node;
#   3. the same at PP = 2: one pipeline stage on each node, the two-node run then stopped by node2's
#      link going down in the middle of its update (the stages' activations and gradients cross
#      it): a named error, and its last checkpoint loads, with the one-node run's weights;
#   4. faults (section 4 below): node2's raylet killed, the resume, node2's link down mid weight
#      sync, a full disk while a checkpoint is written (a preemption with requeue: test-journey's); on the fleet run of part 1
#      (nccl, sync.verify=true: every sync checked by checksums), placed as part 1's is.
# MULTINODE_RUNS (default "sglang2n pp2 faults") picks the parts; KEEP_CLUSTER_DIR=1 keeps the
# job outputs and logs. Part 1 is not in the default (two minutes of CI, for the cluster faults):
# the fault runs sync over the update group between the nodes at every step, verified by
# checksums; what part 1 adds is their end bit for bit on the run in one process. Part 2 is not
# in the default either (it adds two jobs, about 3.5 minutes of CI):
# part 3 crosses the nodes with collectives too (the gradient norm over the model-parallel group,
# the tied embedding's gradient between the first and last stage); what part 2 adds is the
# data-parallel reduce-scatter and all-gather between nodes. Nor is fleetdisk (the fleet run through
# disk, about 4 minutes): sglang2n syncs through disk between the nodes too. All of it:
# MULTINODE_RUNS="fleet fleetdisk sglang2n dp2 pp2 faults".
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${MEGARL_PYTHON:-$REPO/.venv/bin/python}
NODES=${MULTINODE_NODES:-2}
# which parts to run (fewer while working on one; all: fleet fleetdisk sglang2n dp2 pp2 faults)
RUNS=" ${MULTINODE_RUNS:-sglang2n pp2 faults} "
wants() { [[ $RUNS == *" $1 "* ]]; }
source tests/multinode/cluster.sh

cluster_up "$NODES" || exit $?
WORK=$CLUSTER_DIR
started=$SECONDS

# the quickstart's inputs once, for every run (a 20-step warm-up: the runs check the pipeline
# across nodes, not learning)
# (the recipe prepares them too when missing: MEGARL_PREPARE_ARGS makes its settings these, so it finds
# them built; with other settings it would build them all again, a full warm-up, in the first job)
export MEGARL_PREPARE_ARGS="--warmup-steps 20"
# shellcheck disable=SC2086
"$PY" -m megarl.quickstart prepare "$WORK/data" $MEGARL_PREPARE_ARGS > "$WORK/prepare.log" 2>&1 \
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

export MEGARL_DATA_DIR=$WORK/data MEGARL_PYTHON=$PY MEGARL_RAY_PORT=6379
SHORT=(trainer.total_training_steps=2 trainer.test_freq=2 trainer.save_freq=2 algorithm.dynamic_sampling.enable=false
       data.train_batch_size=8 data.gen_batch_size=8)
SPREAD=(cluster.placement_strategy=SPREAD)

# run NAME NODES ARGS...: the quickstart recipe on NODES nodes, output in $WORK/NAME
run() {
    local name=$1 nodes=$2; shift 2
    MEGARL_OUTPUT_DIR=$WORK/$name MLFLOW_TRACKING_URI=sqlite:///$WORK/$name.db \
        sbatch_on_cluster "$name" --nodes="$nodes" examples/quickstart/run_quickstart.sh "${SHORT[@]}" "$@"
}

# fleet_placed NAME: the job ran on 2 nodes, the trainer and the engines on different ones, the
# retrieval server serving at its node's address (searched from the driver on node1)
fleet_placed() {
    local name=$1 placed
    grep -q "Ray is up on 2 node(s)" "$WORK/$name.out"
    placed=$(grep -a "megarl placement:" "$WORK/$name.out" | tail -n 1)
    [[ $placed =~ "train ranks on "([0-9.]+)";".*"rollout engines on "([0-9.]+) && ${BASH_REMATCH[1]} != "${BASH_REMATCH[2]}" ]] \
        || { echo "test-multinode: $name: the trainer and the engines are not on different nodes: $placed" >&2; exit 1; }
    [[ $placed =~ "retrieval server on "([0-9.]+)" at http://"([0-9.]+): && ${BASH_REMATCH[1]} == "${BASH_REMATCH[2]}" ]] \
        || { echo "test-multinode: $name: the retrieval server does not serve at its node's address: $placed" >&2; exit 1; }
}

# --- 1. the engine fleet on another node than the trainer ------------------------------------
FLEET=(rollout.engine=sglang rollout.sglang.server=embedded sync.verify=true)
if wants fleet; then
# the reference, in one process on this host (not a slurm job: 27 s against a job's 100 s)
"$(dirname "$PY")/megarl" train examples/quickstart/search_r1_tiny.yaml "model.path=$MEGARL_DATA_DIR/model" \
    "data.train_files=[$MEGARL_DATA_DIR/data/train.parquet]" "data.val_files=[$MEGARL_DATA_DIR/data/val.parquet]" \
    "agent.retrieval.index_dir=$MEGARL_DATA_DIR/index" "trainer.output_dir=$WORK/fleet_one" "${SHORT[@]}" \
    rollout.engine=local cluster.launcher=inprocess > "$WORK/fleet_one.out" 2>&1 \
    || { tail -n 30 "$WORK/fleet_one.out" >&2; exit 1; }
echo "test-multinode: fleet_one (in one process) ended after $((SECONDS - started)) s"
run fleet_nccl 2 "${FLEET[@]}" sync.transport=nccl "${SPREAD[@]}"
fleet_runs=(fleet_nccl)
if wants fleetdisk; then  # not in the default: sglang2n syncs through disk across the nodes
    run fleet_disk 2 "${FLEET[@]}" sync.transport=disk "${SPREAD[@]}"
    fleet_runs+=(fleet_disk)
fi
for name in "${fleet_runs[@]}"; do
    fleet_placed "$name"
    "$PY" tests/multinode/check_run.py "sqlite:///$WORK/$name.db" "$WORK/$name.out" --steps 2 \
        --nodes "$(node_addr 1),$(node_addr 2)"
    "$PY" tests/multinode/same_weights.py "$WORK/fleet_one/hf" "$WORK/$name/hf" "$WORK/data/model"
done
fi

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

# --- what the fault runs share (sections 3 and 4) ----------------------------------------------
# a checkpoint at every step; the health pings every 5 s, answered within 10 s (cluster.liveness:
# the bounded time a lost node takes to stop the run)
FAULTY=(trainer.total_training_steps=20 trainer.save_freq=1 cluster.liveness.interval_s=5 cluster.liveness.timeout_s=10)
# the run's end after a lost node: missed pings (5 + 10 s), the question which parts are gone (10 s),
# then its bounded cleanup and shutdown; measured 25 s (PP = 2) and 46 s (weight sync), 55-63 s before
# the parts that do not answer were no longer asked to close
LIVENESS_BOUND=90

# submit NAME RUN ARGS...: the quickstart recipe on two nodes with ARGS, not waited for, output in
# $WORK/RUN (several jobs may share it: a rerun resumes); prints the job id (megarl's log at INFO:
# each phase of a step as it begins)
submit() {
    local name=$1 run_name=$2
    shift 2
    MEGARL_LOG_LEVEL=INFO MEGARL_OUTPUT_DIR=$WORK/$run_name MLFLOW_TRACKING_URI=sqlite:///$WORK/$run_name.db on_node 1 sbatch \
        --parsable --job-name="$name" --output="$WORK/$name.out" --chdir="$REPO" \
        --nodes=2 examples/quickstart/run_quickstart.sh "${SHORT[@]}" "$@"
}
job_over() {
    ! on_node 1 scontrol show job "$1" | grep -qE 'JobState=(PENDING|CONFIGURING|RUNNING|COMPLETING|REQUEUE[A-Z_]*)'
}
job_state() { on_node 1 scontrol show job "$1" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
# wait_until SECONDS WHAT CMD...: CMD succeeds within SECONDS, or the test fails naming WHAT
wait_until() {
    local limit=$1 what=$2 end=$((SECONDS + $1))
    shift 2
    until "$@"; do
        (( SECONDS < end )) || { echo "test-multinode: not within $limit s: $what" >&2; return 1; }
        sleep 1
    done
}
# the Ray processes (and megarl's driver) left on node K, one "pid command line" each
ray_left() {
    local pid
    for pid in $(ip netns pids "$(node_ns "$1")"); do
        tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null \
            | grep -aE 'raylet|gcs_server|ray::|default_worker\.py|log_monitor\.py|dashboard/agent|bin/megarl ' \
            | sed "s/^/$pid /" || true
    done
}
no_ray_left() { [[ -z "$(ray_left 1)$(ray_left 2)" ]]; }
none_of() { local pid; for pid in "$@"; do [[ ! -e /proc/$pid ]] || return 1; done; }
newest_whole() {  # the step of the newest checkpoint, once every file in it has its recorded size and CRC32
    "$PY" -c 'import sys; from megarl import checkpoint
p = checkpoint.latest_checkpoint(sys.argv[1]); print(checkpoint.verify(p)["step"])' "$1"
}
saved() { test -f "$WORK/$1/checkpoints/$(printf 'step_%06d' "$2")/meta.json"; }  # RUN STEP
count() { grep -ac -- "$1" "$2" || true; }
more_than() { (( $(count "$2" "$3") > $1 )); }  # N PATTERN FILE: PATTERN on more than N lines of FILE
fault_failed() {  # NAME: the end of its job's output, then fail
    echo "--- the end of $WORK/$1.out" >&2
    tail -n 60 "$WORK/$1.out" >&2
    exit 1
}
none_on() { [[ -z "$(ray_left "$1")" ]]; }
# link_down_mid NAME PHASE: node2's link slowed (4 Mbit/s, so that PHASE lasts seconds), then set
# down at the next PHASE job NAME logs: the run stops within the liveness bound naming node2 and
# PHASE, and no Ray process is left on node1; then the link comes back (node2's Ray, cut off, gives
# up on the head only in its own time, a minute or more) and none is left on node2 either
link_down_mid() {
    local name=$1 phase=$2 out=$WORK/$1.out
    link_slow 2 4mbit
    wait_until 300 "$name: the next phase '$phase'" more_than "$(count "$phase" "$out")" "$phase" "$out" \
        || fault_failed "$name"
    link_down 2
    local down_at=$SECONDS
    wait_until "$LIVENESS_BOUND" "$name: the run's end after node2's link went down" \
        grep -aq "megarl: training stopped:" "$out" || fault_failed "$name"
    local ended=$((SECONDS - down_at))
    grep -a "megarl: training stopped:" "$out" >&2
    grep -aq "megarl: training stopped: step [0-9]*, while $phase: .* on node node2 ($(node_addr 2))" "$out" \
        || { echo "test-multinode: $name: the error does not name node2 and $phase" >&2; fault_failed "$name"; }
    wait_until 60 "$name: every Ray process gone from node1, node2's link still down" none_on 1 \
        || { ray_left 1; exit 1; } >&2
    local gone1=$((SECONDS - down_at))
    link_up 2
    wait_until 120 "$name: every Ray process gone from node2 once its link is back" none_on 2 \
        || { ray_left 2; exit 1; } >&2
    echo "test-multinode: $name: node2's link down while $phase: the run named it $ended s later; no Ray process" \
         "left on node1 $gone1 s later, nor on node2 $((SECONDS - down_at)) s after the link went down (back at $gone1 s)"
}


# --- 1b. one SGLang engine across the two nodes -------------------------------------------------
# SGLang 0.5.23's own server (the venv of `make sglang-env`), TP 2 with one TP rank on each node
# (--nnodes 2 --node-rank 0|1 --dist-init-addr on node rank 0's address), launched by Ray as one
# unit (its ranks pinned to the two nodes in turn); the weights through disk after each step. At
# every step the trainer's log-probs of the sampled tokens are the engine's within 1e-5 on average
# (float32 on both sides; measured 2.2e-7): the engine samples the trainer's policy, each of its
# ranks holding half of every sharded tensor.
SGLANG_PY=${MEGARL_SGLANG_PYTHON:-$REPO/.venv-sglang/bin/python}
if wants sglang2n; then
[[ -x $SGLANG_PY ]] \
    || { echo "test-multinode: no SGLang environment at $SGLANG_PY: build it with make sglang-env" >&2; exit 1; }
run sglang2n 2 rollout.engine=sglang rollout.sglang.server=sglang "rollout.sglang.python=$SGLANG_PY" \
    rollout.num_engines=1 rollout.tensor_parallel_size=2 rollout.nodes_per_engine=2 sync.transport=disk "${SPREAD[@]}"
placed=$(grep -a "megarl placement:" "$WORK/sglang2n.out")
[[ $placed =~ "rollout engines on "([0-9.]+)", "([0-9.]+) ]] \
    || { echo "test-multinode: sglang2n: the engine's two node ranks are not on two nodes: $placed" >&2; exit 1; }
grep -q -- "--node-rank 1 --dist-init-addr" "$WORK/sglang2n/logs/engine0-node1.log" \
    || { echo "test-multinode: sglang2n: node rank 1 was not started as one" >&2; exit 1; }
"$PY" tests/multinode/check_run.py "sqlite:///$WORK/sglang2n.db" "$WORK/sglang2n.out" --steps 2 \
    --nodes "$(node_addr 1),$(node_addr 2)" --at-most rollout/logprob_mismatch=1e-5
fi

# --- 2. two ranks (DP = 2) on two nodes, gloo between the nodes' addresses
wants dp2 && megatron_across_nodes dp2 actor.parallel.data_parallel_size=2
# --- 3. PP = 2: one pipeline stage on each node, and node2's link down mid training collective --
# pp2_one on one node; pp2_two with one stage on each node, a checkpoint at every step (FAULTY):
# once it has saved step 2, node2's link goes down while it updates the actor (the stages send
# each other activations and gradients over it at every micro-batch): the run stops within the
# liveness bound naming node2 and the update, no process is left, and step 2's checkpoints of both
# runs, exported, hold the same weights bit for bit (one stage on each node trains as on one node)
if wants pp2; then
PP2=(actor.backend=megatron actor.parallel.pipeline_model_parallel_size=2 cluster.threads_per_rank=1)
run pp2_one 1 "${PP2[@]}"
job=$(submit pp2_two pp2_two "${PP2[@]}" "${SPREAD[@]}" "${FAULTY[@]}")
wait_until 600 "pp2_two: step 2 saved" saved pp2_two 2 || fault_failed pp2_two
grep -q "megarl placement: train ranks on $(node_addr 1), $(node_addr 2);" "$WORK/pp2_two.out" \
    || { grep "megarl placement" "$WORK/pp2_two.out" >&2
         echo "test-multinode: pp2_two: the two stages are not on two nodes" >&2; exit 1; }
link_down_mid pp2_two "updating the actor"
wait_until 300 "pp2_two: the job's end once the link is back" job_over "$job" || fault_failed pp2_two
[[ $(job_state "$job") == FAILED ]] || fault_failed pp2_two
"$PY" tests/multinode/check_run.py "sqlite:///$WORK/pp2_two.db" "$WORK/pp2_two.out" --status FAILED --steps 2 --at-least
for name in pp2_one pp2_two; do
    "$(dirname "$PY")/megarl" export --run "$WORK/$name" --checkpoint "$WORK/$name/checkpoints/step_000002" \
        --out "$WORK/${name}_step2" > "$WORK/${name}_export.out" 2>&1 || fault_failed "${name}_export"
done
"$PY" tests/multinode/same_weights.py "$WORK/pp2_one_step2" "$WORK/pp2_two_step2" "$WORK/data/model"
echo "test-multinode: pp2_two: job $job FAILED; its step 2 checkpoint loads, the weights of pp2_one's"
fi

# --- 4. faults across nodes ---------------------------------------------------------------------
# One run directory, a checkpoint at every step, the engines and the trainer on different nodes
# (which on which is Ray's choice); the driver on node1; the health pings every 5 s, answered
# within 10 s (cluster.liveness: the bounded time a lost node takes to stop the run). In turn:
#   fault_kill   node2's raylet killed (SIGKILL) once step 1 is saved: the job fails within a
#                bounded time naming the parts lost on node2, no Ray process is left, the newest
#                checkpoint is whole;
#   fault_rerun  the same command resumes from it in the same MLflow run; once it has saved a step,
#                node2's link goes down in the middle of a weight sync (the link slowed first, so
#                that the 7.5 MB sync lasts seconds): the run stops within the liveness bound naming
#                node2 and the sync, and no process is left on either node (node2's Ray ends itself
#                once the head is out of reach). A slurm preemption, its requeue and the resume
#                are test-journey's (docs/slurm.md's recipe, preempted by the partition `urgent`);
#   disk_full    (one process, on this host) the run's disk fills up while step 2's checkpoint is
#                written: a named error with the path, and step 1's checkpoint still loads (the
#                run exported from it).
# At the end the run's one MLflow run has every step from 1, and the newest checkpoint's data
# order is the one of that many steps from the start: the resumes kept the order.
FAULT_ARGS=("${FLEET[@]}" sync.transport=nccl "${SPREAD[@]}" "${FAULTY[@]}")
if wants faults; then
job=$(submit fault_kill fault "${FAULT_ARGS[@]}")
wait_until 600 "fault_kill: its first checkpoint" saved fault 1 || fault_failed fault_kill
raylets=$(for pid in $(ip netns pids "$(node_ns 2)"); do
              if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == raylet ]]; then echo "$pid"; fi; done)
[[ -n $raylets ]] || { echo "test-multinode: fault_kill: no raylet on node2" >&2; fault_failed fault_kill; }
fleet_placed fault_kill
kill -KILL $raylets
killed_at=$SECONDS
wait_until 300 "fault_kill: the run's end after node2's raylet was killed" job_over "$job" || fault_failed fault_kill
echo "test-multinode: fault_kill: node2's raylet killed (SIGKILL); job $job $(job_state "$job") $((SECONDS - killed_at)) s later"
[[ $(job_state "$job") == FAILED ]] || fault_failed fault_kill
grep -a "megarl: training stopped:" "$WORK/fault_kill.out" >&2 || fault_failed fault_kill
grep -aq "gone on node node2 ($(node_addr 2)" "$WORK/fault_kill.out" \
    || { echo "test-multinode: fault_kill: the error names no part gone on node2" >&2; fault_failed fault_kill; }
wait_until 60 "fault_kill: every Ray process gone" no_ray_left || { ray_left 1; ray_left 2; exit 1; } >&2
kept=$(newest_whole "$WORK/fault/checkpoints")
echo "test-multinode: fault_kill: no Ray process left; the newest checkpoint (step $kept) is whole"

# the same command resumes (a preemption, its requeue and resume: test-journey)
job=$(submit fault_rerun fault "${FAULT_ARGS[@]}")
wait_until 600 "fault_rerun: resumed from step $kept" grep -asq "megarl: resumed from .*(step $kept)" \
    "$WORK/fault_rerun.out" || fault_failed fault_rerun
wait_until 300 "fault_rerun: a checkpoint after the resume" saved fault $((kept + 1)) || fault_failed fault_rerun

# node2's link down in the middle of a weight sync
link_down_mid fault_rerun "syncing the weights to the engines"
wait_until 300 "fault_rerun: the job's end once the link is back" job_over "$job" || fault_failed fault_rerun
[[ $(job_state "$job") == FAILED ]] || fault_failed fault_rerun
steps=$(newest_whole "$WORK/fault/checkpoints")
"$PY" tests/multinode/check_run.py "sqlite:///$WORK/fault.db" "$WORK/fault_rerun.out" --status FAILED \
    --steps "$steps" --at-least --order-of "$WORK/fault/checkpoints" --batch 8
echo "test-multinode: fault_rerun: job $job FAILED; the newest checkpoint (step $steps) is whole"

# the disk fills up while a checkpoint is written (one process on this host: the disk is what fails)
small_disk "$WORK/small" 64m
disk_run=("$(dirname "$PY")/megarl" train examples/quickstart/search_r1_tiny.yaml "model.path=$MEGARL_DATA_DIR/model"
          "data.train_files=[$MEGARL_DATA_DIR/data/train.parquet]" "data.val_files=[$MEGARL_DATA_DIR/data/val.parquet]"
          "agent.retrieval.index_dir=$MEGARL_DATA_DIR/index" "trainer.output_dir=$WORK/small/run" "${SHORT[@]}"
          trainer.total_training_steps=3 trainer.save_freq=1 rollout.engine=local cluster.launcher=inprocess)
"${disk_run[@]}" > "$WORK/disk_full.out" 2>&1 &
disk_pid=$!
wait_until 300 "disk_full: its first checkpoint" test -f "$WORK/small/run/checkpoints/step_000001/meta.json" \
    || { kill "$disk_pid"; fault_failed disk_full; }
fallocate -l $(( $(df -B1 --output=avail "$WORK/small" | tail -n 1) - (1 << 20) )) "$WORK/small/filler"  # 1 MiB left
status=0
wait "$disk_pid" || status=$?
grep -a "megarl: training stopped:" "$WORK/disk_full.out" >&2 || fault_failed disk_full
[[ $status == 1 ]] && grep -aq "megarl: training stopped: checkpoint step 2 was not saved: the disk holding $WORK/small/run/checkpoints is full" \
    "$WORK/disk_full.out" || { echo "test-multinode: disk_full: exit $status, no named error" >&2; fault_failed disk_full; }
[[ $(newest_whole "$WORK/small/run/checkpoints") == 1 ]] || fault_failed disk_full
rm "$WORK/small/filler"
"$(dirname "$PY")/megarl" export --run "$WORK/small/run" --out "$WORK/disk_export" > "$WORK/disk_export.out" 2>&1 \
    || fault_failed disk_export
echo "test-multinode: disk_full: step 2's checkpoint failed naming the full disk; step 1's is whole and loads (exported)"
fi

echo "test-multinode: passed in $((SECONDS - started)) s"
