# Ray on a slurm allocation, for megarl's recipes. Source it, then run the driver through it:
#
#   source tools/ray_on_slurm.sh
#   ray_on_slurm megarl train examples/dapo/dapo_qwen2.5_32b.yaml key=value ...
#
# ray_on_slurm starts a Ray head on the first node of the job (an `srun` step) and one worker
# on each other node, waits until Ray sees every node (MEGARL_RAY_START_TIMEOUT seconds, default 600),
# then runs the command here (the batch host, which is the first node) with RAY_ADDRESS set, so
# `cluster.ray_address=auto` joins that cluster. When the command ends, fails, or the job is
# cancelled, the Ray steps it started are stopped (by their own process ids; nothing is killed
# by name) and the command's exit status is returned.
#
# Signals: the command runs in the background and the shell waits for it, so a SIGTERM or SIGINT
# to the batch shell (`scancel --batch --signal=TERM`, `#SBATCH --signal=B:TERM@300` before the
# time limit) is handled at once: passed on to the command as SIGTERM (`megarl train` then stops
# like Ctrl-C: MLflow status, its actors and servers, exit 143), Ray stopped once it has exited,
# and its status returned. A plain `scancel` or the time limit sends SIGTERM to every process of
# the job at once (the driver and the Ray steps too), then SIGKILL KillWait seconds later;
# megarl counts the copy passed on as the same request (docs/slurm.md). A preemption in a
# partition with a GraceTime signals the Ray steps first and this shell GraceTime seconds later:
# the head's step relays its SIGTERM here, so the command stops as Ray does, not after it.
#
# Settings (environment): MEGARL_PYTHON (the python with megarl installed; default the
# repository's .venv, else the python3 on PATH: see megarl_install), MEGARL_RAY_PORT (6379),
# MEGARL_RAY_NUM_CPUS / MEGARL_RAY_NUM_GPUS per node
# (default: what slurm gives the job on a node; GPUs from SLURM_GPUS_ON_NODE, else 0),
# RAY_TMPDIR (Ray's session files; default /tmp/ray-$SLURM_JOB_ID, one per job), RAY_AUTH_TOKEN
# (default: a fresh random token per job; Ray's token authentication is on),
# RAY_enable_metrics_collection (default 0: Ray's per-node Prometheus exporter, which answers
# without a token on every interface, is off; docs/slurm.md says which ports of Ray stay open).

_ray_on_slurm_steps=()
_ray_on_slurm_command=""  # the process id of the command while it runs
_ray_on_slurm_stopping=""  # set while the Ray steps are being stopped

_ray_on_slurm_log() { echo "[ray_on_slurm $(date +%H:%M:%S)] $*" >&2; }

# The Ray steps (and the retrieval server's): SIGTERM to each srun, which passes it to its task
# (`ray start --block` then stops that node's Ray processes, as `ray stop` does for them); those
# still running after MEGARL_RAY_STOP_TIMEOUT seconds (default 60) get SIGKILL.
_ray_on_slurm_stop() {
    local pid deadline=$((SECONDS + ${MEGARL_RAY_STOP_TIMEOUT:-60}))
    _ray_on_slurm_stopping=1  # the head step relays the SIGTERM it is stopped with: not a new request
    for pid in "${_ray_on_slurm_steps[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${_ray_on_slurm_steps[@]}"; do
        while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do
            sleep 1
        done
        if kill -0 "$pid" 2>/dev/null; then
            _ray_on_slurm_log "step process $pid did not stop within ${MEGARL_RAY_STOP_TIMEOUT:-60} s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        wait "$pid" 2>/dev/null || true
    done
    _ray_on_slurm_steps=()
    _ray_on_slurm_stopping=""
}

# A signal to this shell: passed on to the command as SIGTERM while it runs (ray_on_slurm then
# waits for it and stops Ray); before it started, Ray is stopped and the shell exits 128 + signal.
_ray_on_slurm_signal() {
    [[ -z "$_ray_on_slurm_stopping" ]] || return 0
    if [[ -n "$_ray_on_slurm_command" ]] && kill -0 "$_ray_on_slurm_command" 2>/dev/null; then
        _ray_on_slurm_log "SIG$1: passing SIGTERM to the command (pid $_ray_on_slurm_command); Ray is stopped once it exits"
        kill -TERM "$_ray_on_slurm_command" 2>/dev/null || true
        return
    fi
    _ray_on_slurm_log "SIG$1: stopping Ray"
    _ray_on_slurm_stop
    exit $((128 + $(kill -l "$1")))
}

# megarl_install: the python that runs megarl and the megarl and ray commands of its install,
# in MEGARL_PY, MEGARL_CMD and MEGARL_RAY. The python is MEGARL_PYTHON, else the repository's
# .venv (`make setup`), else the python3 on PATH (`pip install` into a container's environment,
# docs/install.md); the commands are the ones next to it, else the ones on PATH (pip puts a
# system python's scripts in another directory), "" where neither has one (_megarl_needs).
# Status 2, saying what to do, where megarl or Ray is not installed for that python.
megarl_install() {
    local repo=${MEGARL_HOME:-${SLURM_SUBMIT_DIR:-$PWD}} bin
    MEGARL_PY=${MEGARL_PYTHON:-}
    if [[ -z "$MEGARL_PY" ]]; then
        if [[ -x "$repo/.venv/bin/python" ]]; then MEGARL_PY=$repo/.venv/bin/python; else MEGARL_PY=$(command -v python3 || true); fi
    fi
    # found, not imported (importing Ray takes seconds)
    if [[ -z "$MEGARL_PY" ]] || ! "$MEGARL_PY" -c "import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ('megarl.cli', 'ray')))" 2>/dev/null; then
        echo "megarl: ${MEGARL_PY:-python3 (none on PATH)} cannot run megarl (no megarl or no Ray installed there):" \
             "install it into the environment the job runs in (docs/install.md#gpu-machine)," \
             "or set MEGARL_PYTHON to a python that has it" >&2
        return 2
    fi
    bin=$(dirname "$MEGARL_PY")
    MEGARL_CMD=$bin/megarl MEGARL_RAY=$bin/ray
    [[ -x "$MEGARL_CMD" ]] || MEGARL_CMD=$(command -v megarl || true)
    [[ -x "$MEGARL_RAY" ]] || MEGARL_RAY=$(command -v ray || true)
    return 0
}

# _megarl_needs NAME: status 2, saying what to do, where megarl_install found no NAME command
# (megarl or ray) for its python.
_megarl_needs() {
    local found=$MEGARL_CMD
    [[ $1 == ray ]] && found=$MEGARL_RAY
    [[ -n "$found" ]] && return 0
    echo "megarl: $MEGARL_PY has megarl and Ray, but no $1 command is next to it or on PATH: add the" \
         "directory pip installed their scripts to to PATH" >&2
    return 2
}

ray_on_slurm() {
    if [[ -z "${SLURM_JOB_ID:-}" ]]; then
        echo "ray_on_slurm: not inside a slurm job (submit the recipe with sbatch)" >&2
        return 2
    fi
    local py ray port cpus gpus tmp head head_ip deadline status
    megarl_install && _megarl_needs ray || return
    py=$MEGARL_PY ray=$MEGARL_RAY
    port=${MEGARL_RAY_PORT:-6379}
    cpus=${MEGARL_RAY_NUM_CPUS:-${SLURM_CPUS_ON_NODE:-1}}
    gpus=${MEGARL_RAY_NUM_GPUS:-${SLURM_GPUS_ON_NODE:-0}}
    tmp=${RAY_TMPDIR:-/tmp/ray-$SLURM_JOB_ID}
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    head=${nodes[0]}
    # the address Ray itself picks on that node (hostname -i can answer a loopback address)
    head_ip=$(srun --overlap --nodes=1 --ntasks=1 -w "$head" "$py" -c \
        "from ray._private.services import get_node_ip_address; print(get_node_ip_address())")
    [[ -n "$head_ip" ]] || { echo "ray_on_slurm: cannot find the address of $head" >&2; return 1; }

    # Ray's token authentication with a token of this job's own: srun hands the environment to
    # every step, so the nodes, the driver and the actors share it and nobody else can connect
    export RAY_AUTH_MODE=token
    export RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$("$py" -c 'import secrets; print(secrets.token_hex(32))')}
    # Ray binds its metrics exporter to every interface of a node whose address is not loopback
    # and has no option to bind it to the node's address: off unless asked for
    export RAY_enable_metrics_collection=${RAY_enable_metrics_collection:-0}
    # the job's end, by which megarl has saved and stopped (trainer.save_before_job_end): a requeued
    # job has an end of its own, so it is asked for each time
    if [[ -z "${MEGARL_JOB_END_TIME:-}" ]] && MEGARL_JOB_END_TIME=$(_ray_on_slurm_job_end); then
        export MEGARL_JOB_END_TIME
        _ray_on_slurm_log "the job ends at $(date -d "@$MEGARL_JOB_END_TIME" '+%F %T') (MEGARL_JOB_END_TIME)"
    fi

    trap '_ray_on_slurm_signal TERM' TERM
    trap '_ray_on_slurm_signal INT' INT
    _ray_on_slurm_log "Ray head on $head ($head_ip:$port), ${#nodes[@]} node(s), $cpus CPUs and $gpus GPUs each"
    # the head's step relays a SIGTERM to this shell (same node), which passes it to the command:
    # a preemption with a partition GraceTime signals the job's steps GraceTime seconds before
    # the batch shell, and Ray, stopping at once, would leave the run without its actors
    # shellcheck disable=SC2016
    srun --overlap --nodes=1 --ntasks=1 -w "$head" bash -c '
        trap "kill -TERM $1 \$ray_pid 2>/dev/null" TERM
        shift
        "$@" &
        ray_pid=$!
        while kill -0 "$ray_pid" 2>/dev/null; do wait "$ray_pid"; done
        wait "$ray_pid"' relay-term-to-batch-shell "$$" \
        "$ray" start --head --block --node-ip-address="$head_ip" --port="$port" --num-cpus="$cpus" \
        --num-gpus="$gpus" --temp-dir="$tmp" --include-dashboard=false &
    _ray_on_slurm_steps+=($!)
    local node
    for node in "${nodes[@]:1}"; do
        sleep 2  # the head first
        srun --overlap --nodes=1 --ntasks=1 -w "$node" \
            "$ray" start --block --address="$head_ip:$port" --num-cpus="$cpus" --num-gpus="$gpus" &
        _ray_on_slurm_steps+=($!)
    done

    deadline=$((SECONDS + ${MEGARL_RAY_START_TIMEOUT:-600}))
    until timeout 60 "$py" - "$head_ip:$port" "${#nodes[@]}" 2>/dev/null <<'EOF'
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
alive = sum(1 for n in ray.nodes() if n["Alive"])
sys.exit(0 if alive >= int(sys.argv[2]) else 1)
EOF
    do
        if (( SECONDS > deadline )); then
            _ray_on_slurm_log "Ray did not see all ${#nodes[@]} nodes within ${MEGARL_RAY_START_TIMEOUT:-600} s; stopping"
            _ray_on_slurm_stop
            return 1
        fi
        local pid
        for pid in "${_ray_on_slurm_steps[@]}"; do
            if ! kill -0 "$pid" 2>/dev/null; then
                _ray_on_slurm_log "a Ray start step exited early; see the job's output above"
                _ray_on_slurm_stop
                return 1
            fi
        done
        sleep 3
    done
    _ray_on_slurm_log "Ray is up on ${#nodes[@]} node(s); running: $*"
    # in the background, so that a signal is handled now (bash runs a trap only once a foreground
    # command has ended); the trap passes SIGTERM on (a background command ignores SIGINT)
    RAY_ADDRESS="$head_ip:$port" "$@" &
    _ray_on_slurm_command=$!
    # errexit off while waiting: bash 5.2 with `set -e` (the recipes) exits when a trap has run
    # during `wait`, even inside `wait || true`, which would leave the command and Ray behind
    local errexit=0
    [[ $- == *e* ]] && errexit=1
    set +e
    while kill -0 "$_ray_on_slurm_command" 2>/dev/null; do
        wait "$_ray_on_slurm_command"  # back early when a signal came; the trap passed it on
    done
    wait "$_ray_on_slurm_command"  # the command's own status (bash keeps it)
    status=$?
    (( errexit )) && set -e
    _ray_on_slurm_command=""
    _ray_on_slurm_log "command exited with status $status; stopping Ray"
    _ray_on_slurm_stop
    trap - TERM INT
    if (( status == 143 )); then
        _ray_on_slurm_requeue_if_taken
    elif (( status == 75 )); then  # megarl saved and stopped before the job's end (megarl/job_time.py)
        _ray_on_slurm_requeue_if_taken "" "megarl saved before the job's end"
    elif (( status != 0 )); then  # a preemption's SIGTERM stops Ray's processes too: the command may fail first
        _ray_on_slurm_requeue_if_taken "$status"
    fi
    return "$status"
}

# After the command stopped on SIGTERM: if slurm is taking the job away (it was preempted, or its
# time limit is within MEGARL_REQUEUE_WINDOW seconds, default 600: the recipes' --signal=B:TERM@300)
# and it was submitted with --requeue, requeue it now: it runs again and megarl resumes from the
# newest checkpoint. Slurm requeues a preempted job itself only if the job outlives the
# partition's GraceTime, and a run that stops cleanly ends sooner (as a failed job). A stop by
# hand (scancel --batch --signal=TERM, far from the time limit) is not requeued. With an argument
# (the status of a command that failed rather than stopped): requeued only if it was preempted
# (the preemption signals Ray's processes, which stop at once; the run may fail on a lost part
# before its own SIGTERM arrives). With a second argument (why; after megarl's exit 75, saved
# before the job's end): requeued if submitted with --requeue, however far the end is.
_ray_on_slurm_requeue_if_taken() {
    local failed=${1:-} info why=${2:-} end
    info=$(timeout 30 scontrol show job "$SLURM_JOB_ID" 2>/dev/null) || { _ray_on_slurm_log "cannot ask slurm about job $SLURM_JOB_ID; not requeued"; return 0; }
    if [[ -n $why ]]; then
        :  # the command says why (a second argument): requeued whatever the time left
    elif [[ $info =~ PreemptTime=([0-9][0-9T:-]+) ]]; then
        why="preempted at ${BASH_REMATCH[1]}"
        [[ -z $failed ]] || why="the command failed (status $failed) and the job was $why"
    elif [[ -n $failed ]]; then
        return 0
    elif [[ $info =~ EndTime=([0-9][0-9T:-]+) ]] && end=$(date -d "${BASH_REMATCH[1]}" +%s 2>/dev/null) \
            && (( end - $(date +%s) < ${MEGARL_REQUEUE_WINDOW:-600} )); then
        why="its time limit is $(( end - $(date +%s) )) s away"
    fi
    [[ -n $why ]] || return 0
    if [[ ! $info =~ Requeue=1 ]]; then
        _ray_on_slurm_log "$why; not requeued: the job was submitted without --requeue (submit the same command again to resume)"
        return 0
    fi
    _ray_on_slurm_log "$why: requeueing job $SLURM_JOB_ID; it resumes from its newest checkpoint"
    timeout 30 scontrol requeue "$SLURM_JOB_ID" || _ray_on_slurm_log "scontrol requeue $SLURM_JOB_ID failed"
}


# The job's time limit as sbatch --time writes it, printed (nothing when unknown or unlimited): in a
# job, slurm's TimeLimit; in a dry run outside slurm, the recipe's own #SBATCH --time line.
_ray_on_slurm_job_time() {
    local info limit=""
    if [[ -n "${SLURM_JOB_ID:-}" ]]; then
        info=$(timeout 30 scontrol show job "$SLURM_JOB_ID" 2>/dev/null) && [[ $info =~ TimeLimit=([0-9][0-9:-]*) ]] \
            && limit=${BASH_REMATCH[1]}
    elif [[ -f "$0" ]]; then
        limit=$(sed -n 's/^#SBATCH --time=\([0-9][0-9:-]*\).*/\1/p' "$0" | head -n 1)
    fi
    echo "$limit"
}

# The job's end in Unix seconds (slurm's EndTime), printed; status 1 when slurm does not say.
_ray_on_slurm_job_end() {
    local info
    info=$(timeout 30 scontrol show job "$SLURM_JOB_ID" 2>/dev/null) || return 1
    [[ $info =~ EndTime=([0-9][0-9T:-]+) ]] && date -d "${BASH_REMATCH[1]}" +%s 2>/dev/null
}


# megarl_train_on_slurm CONFIG [key=value ...]: what every GPU recipe does after setting its
# defaults. Reads MEGARL_MODEL_PATH, MEGARL_OUTPUT_DIR, MLFLOW_TRACKING_URI, MEGARL_NNODES (the
# job's nodes, and a different value is refused; required outside slurm), MEGARL_GPUS_PER_NODE
# [8], MEGARL_GPU_MEMORY [80GB], MEGARL_PLAN_MODEL (the model `megarl plan` sizes while
# MEGARL_MODEL_PATH has no config.json yet) and MEGARL_PLAN_ARGS (more `megarl plan` flags, e.g.
# --rollout-gpus), MEGARL_SGLANG_PYTHON (the python of SGLang's own environment: rollout.sglang.python;
# default the run's). The layout (actor TP / PP / DP, recompute, offload, engine TP, SGLang memory
# fraction) is the one `megarl plan --config CONFIG key=value ...` recommends for the job's nodes,
# planned from the run's own config and overrides (sequence lengths, batch, critic, KL), unless
# MEGARL_LAYOUT is set. Prints what it runs; with MEGARL_DRY_RUN=1 it only validates the
# assembled run (`megarl train --dry-run`: the config, and the model and data paths), no cluster.
megarl_train_on_slurm() {
    local config=$1; shift
    local megarl nodes=${MEGARL_NNODES:-${SLURM_JOB_NUM_NODES:-}}
    megarl_install && _megarl_needs megarl || return
    megarl=$MEGARL_CMD
    if [[ -z "$nodes" ]]; then  # a dry run outside slurm: the plan depends on it
        echo "megarl: how many nodes? Outside a slurm job set MEGARL_NNODES (e.g. MEGARL_NNODES=8 MEGARL_DRY_RUN=1)" >&2
        return 2
    fi
    if [[ -n "${SLURM_JOB_NUM_NODES:-}" && "$nodes" != "$SLURM_JOB_NUM_NODES" ]]; then
        echo "megarl: MEGARL_NNODES=$nodes but the job has $SLURM_JOB_NUM_NODES nodes; submit with sbatch --nodes=$nodes" >&2
        return 2
    fi
    local plan_model=$MEGARL_MODEL_PATH
    [[ -f "$MEGARL_MODEL_PATH/config.json" ]] || plan_model=${MEGARL_PLAN_MODEL:?MEGARL_MODEL_PATH has no config.json: set MEGARL_PLAN_MODEL}
    local layout=${MEGARL_LAYOUT:-} job_time
    job_time=$(_ray_on_slurm_job_time)
    if [[ -z "$layout" ]]; then
        # the step-time estimate (docs/planning.md) goes to the log, before anything starts, and a
        # warning where a step or save_freq steps would not fit in the job's time
        # shellcheck disable=SC2086
        layout=$("$megarl" plan --config "$config" "$@" --model "$plan_model" --nodes "$nodes" \
                 --gpus-per-node "${MEGARL_GPUS_PER_NODE:-8}" --gpu-memory "${MEGARL_GPU_MEMORY:-80GB}" \
                 ${job_time:+--job-time "$job_time"} ${MEGARL_PLAN_ARGS:-} --overrides) || {
            echo "megarl: no layout of $plan_model fits $nodes nodes (megarl plan above)" >&2; return 1; }
    fi
    local args=(train "$config" "model.path=$MEGARL_MODEL_PATH" "trainer.output_dir=$MEGARL_OUTPUT_DIR"
                "cluster.ray_address=auto" "cluster.nnodes=$nodes" "cluster.gpus_per_node=${MEGARL_GPUS_PER_NODE:-8}")
    [[ -n "${MLFLOW_TRACKING_URI:-}" ]] && args+=("tracking.uri=$MLFLOW_TRACKING_URI")
    if [[ -n "${MEGARL_SGLANG_PYTHON:-}" ]]; then  # SGLang in an environment of its own (docs/install.md)
        [[ -x "$MEGARL_SGLANG_PYTHON" ]] || {
            echo "megarl: MEGARL_SGLANG_PYTHON=$MEGARL_SGLANG_PYTHON is not an executable python (docs/install.md#gpu-machine)" >&2
            return 2; }
        args+=("rollout.sglang.python=$MEGARL_SGLANG_PYTHON")
    fi
    # shellcheck disable=SC2206
    args+=($layout "$@")
    echo "megarl on slurm job ${SLURM_JOB_ID:-?} ($nodes nodes): $megarl ${args[*]}"
    if [[ -n "${MEGARL_DRY_RUN:-}" ]]; then  # check the assembled run without a cluster
        "$megarl" "${args[@]}" --dry-run
        return
    fi
    ray_on_slurm "$megarl" "${args[@]}"
}


# retrieval_on_slurm INDEX_DIR [NODE]: megarl's retrieval server (`megarl retrieval serve`) as a
# step on NODE (default the job's last node), bound to that node's address; waits for its
# /health (MEGARL_RETRIEVAL_START_TIMEOUT seconds, default 1800: a dense wiki-18 index takes minutes to
# load), exports MEGARL_RETRIEVAL_URL, and is stopped with the Ray steps. MEGARL_RETRIEVAL_ARGS go to serve.
# The server requires MEGARL_RETRIEVAL_API_KEY (default: a fresh one per job), which srun hands
# to it and the run's retrieval client reads from the same environment.
retrieval_on_slurm() {
    local index=$1 node=${2:-}
    local py port=${MEGARL_RETRIEVAL_PORT:-8000} address deadline
    megarl_install && _megarl_needs megarl || return
    if [[ -n "${MEGARL_DRY_RUN:-}" ]]; then  # the index checked as serve opens it; no server started
        "$MEGARL_CMD" retrieval check --index "$index" || return
        export MEGARL_RETRIEVAL_URL="http://retrieval-node:$port/retrieve"  # the run's dry run needs a URL
        return
    fi
    py=$MEGARL_PY
    [[ -n "$node" ]] || node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n 1)
    export MEGARL_RETRIEVAL_API_KEY=${MEGARL_RETRIEVAL_API_KEY:-$("$py" -c 'import secrets; print(secrets.token_urlsafe(32))')}
    address=$(srun --overlap --nodes=1 --ntasks=1 -w "$node" "$py" -c \
        "from ray._private.services import get_node_ip_address; print(get_node_ip_address())")
    _ray_on_slurm_log "retrieval server for $index on $node ($address:$port)"
    # shellcheck disable=SC2086
    srun --overlap --nodes=1 --ntasks=1 -w "$node" "$MEGARL_CMD" retrieval serve --index "$index" \
        --host "$address" --port "$port" ${MEGARL_RETRIEVAL_ARGS:-} &
    _ray_on_slurm_steps+=($!)
    deadline=$((SECONDS + ${MEGARL_RETRIEVAL_START_TIMEOUT:-1800}))
    until "$py" -c "import sys, httpx; sys.exit(httpx.get('http://$address:$port/health', timeout=5).status_code != 200)" \
            2>/dev/null; do
        if (( SECONDS > deadline )) || ! kill -0 "${_ray_on_slurm_steps[-1]}" 2>/dev/null; then
            _ray_on_slurm_log "the retrieval server did not come up; stopping"
            _ray_on_slurm_stop
            return 1
        fi
        sleep 5
    done
    export MEGARL_RETRIEVAL_URL="http://$address:$port/retrieve"
}
