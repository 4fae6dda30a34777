# The journey's hooks (tests/journey/run.sh sources this on node1, in the fresh checkout, before
# the script tests/journey/blocks.py makes of docs/slurm.md): journey_before / journey_after
# around every block, and journey_instead_NAME for each block that cannot run here as written
# (its mark in the docs says why and what runs instead). Reads JOURNEY_WORK (the test's
# directory), JOURNEY_ENV (the venv standing in for the container's environment, on PATH first),
# JOURNEY_INPUTS (`python -m megarl.quickstart prepare-math` output: a tiny model of Qwen2.5's
# architecture and arithmetic problems in DAPO-Math's published format), JOURNEY_TORCH (the
# container's torch: a pip requirement), SGLANG_PY (SGLang 0.5.23's CPU environment) and
# TEST_PY (the test's own python, for its checks).

journey_log() { echo "[journey $(date +%H:%M:%S)] $*" >&2; }
journey_fail() { echo "journey: FAILED at $JOURNEY_STEP: $*" >&2; exit 1; }

journey_before() {
    JOURNEY_STEP=$1
    journey_log "step $1"
}

journey_after() {
    case $1 in
        install)
            [[ $(command -v megarl) == "$JOURNEY_ENV/bin/megarl" ]] \
                || journey_fail "megarl on PATH is $(command -v megarl), not the install's" ;;
        model) [[ -f models/Qwen2.5-32B/config.json ]] || journey_fail "no model at models/Qwen2.5-32B" ;;
        data)
            for f in data/dapo/dapo-math-17k.parquet data/dapo/aime-2024.parquet; do
                [[ -s $f ]] || journey_fail "$f was not written"
            done ;;
        mlflow)  # the server answers before anything is submitted to it
            local deadline=$((SECONDS + 120))
            until "$TEST_PY" -c "import sys, httpx; sys.exit(httpx.get(sys.argv[1] + '/health', timeout=5).status_code != 200)" \
                    "$MLFLOW_TRACKING_URI" 2>/dev/null; do
                (( SECONDS < deadline )) || journey_fail "the MLflow server at $MLFLOW_TRACKING_URI did not answer; $(tail -n 20 mlflow/server.log)"
                sleep 2
            done ;;
        export) [[ -f models/Qwen2.5-32B-dapo/config.json ]] || journey_fail "no exported model" ;;
    esac
    journey_log "step $1 done"
}

# 1. `pip install -e '.[gpu]'`: the GPU extra (Transformer Engine, SGLang's CUDA build) needs
# CUDA. A fresh venv holds the container's part (its torch), then the block's command with the
# extra's part that runs on the CPU (JOURNEY_ROUTER: sglang-router, as pinned there); the block's
# other lines as written.
journey_instead_install() {
    "${JOURNEY_BASE_PYTHON:-python3}" -m venv "$JOURNEY_ENV"
    pip install -q --no-compile "$JOURNEY_TORCH"
    pip install -q --no-compile -e . "$JOURNEY_ROUTER"
    export MEGARL_SGLANG_PYTHON=$SGLANG_PY  # SGLang's own environment: the recipe gives it to the run
    hash -r
    megarl --version
}

# 2. the model from the hub: the tiny model stands in for Qwen2.5-32B
journey_instead_model() {
    mkdir -p models
    cp -r "$JOURNEY_INPUTS/model" models/Qwen2.5-32B
}

# 3. the data sets from the hub: arithmetic problems in the published format, at those paths
journey_instead_download() {
    mkdir -p downloads/dapo-math-17k/data downloads/aime-2024/data
    cp "$JOURNEY_INPUTS/data/train.parquet" downloads/dapo-math-17k/data/dapo-math-17k.parquet
    cp "$JOURNEY_INPUTS/data/val.parquet" downloads/aime-2024/data/aime-2024.parquet
}

# 6. `sbatch examples/dapo/run_dapo_qwen2.5_32b.sh` on 8 nodes of 8 GPUs: here the same recipe on
# the two CPU nodes: no GPUs (MEGARL_GPUS_PER_NODE=0, so the layout is given, not planned), a
# tiny batch, short responses, the Megatron actor on one node and SGLang's own CPU server on the
# other. Once it has saved step 1, a job of the partition `urgent` preempts it: it stops cleanly,
# requeues itself and resumes from its newest checkpoint, in the same MLflow run, to the end.
JOURNEY_STEPS=4
JOURNEY_TINY=(model.dtype=float32 data.max_prompt_length=256 data.train_batch_size=4 data.gen_batch_size=4
              rollout.n=4 rollout.max_response_length=24 algorithm.overlong.buffer_len=8 rollout.val.n=2
              algorithm.dynamic_sampling.enable=false actor.ppo_mini_batch_size=4 actor.ppo_micro_batch_size=4
              actor.optim.lr=1e-4 actor.optim.lr_warmup_steps=0 actor.parallel.sequence_parallel=false
              trainer.total_training_steps=$JOURNEY_STEPS trainer.save_freq=1 trainer.test_freq=2
              reward.num_workers=1 rollout.sglang.server=sglang
              rollout.num_engines=1 rollout.max_concurrency=16 cluster.threads_per_rank=1
              cluster.placement_strategy=SPREAD)
JOURNEY_LAYOUT="actor.parallel.tensor_model_parallel_size=1 actor.parallel.pipeline_model_parallel_size=1 \
actor.parallel.data_parallel_size=1 rollout.tensor_parallel_size=1"

journey_job_state() { scontrol show job "$1" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
journey_wait() {  # SECONDS WHAT CMD...: CMD succeeds within SECONDS, else the journey fails naming WHAT
    local limit=$1 end=$((SECONDS + $1)) what=$2
    shift 2
    until "$@"; do
        if [[ -n ${JOURNEY_JOB:-} && $1 != journey_over ]] && journey_over; then
            journey_fail "job $JOURNEY_JOB ended $(journey_job_state "$JOURNEY_JOB") before $what; its output ends:
$(tail -n 40 "$JOURNEY_OUT" 2>/dev/null)"
        fi
        (( SECONDS < end )) || journey_fail "not within $limit s: $what; the job's output ends:
$(tail -n 40 "$JOURNEY_OUT" 2>/dev/null)"
        sleep 2
    done
}
journey_saved() { [[ -f outputs/dapo_qwen2.5_32b/checkpoints/$(printf 'step_%06d' "$1")/meta.json ]]; }
journey_over() { [[ $(journey_job_state "$JOURNEY_JOB") =~ ^(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL)$ ]]; }

journey_instead_submit() {
    JOURNEY_JOB=$(MEGARL_GPUS_PER_NODE=0 MEGARL_LAYOUT=$JOURNEY_LAYOUT \
                  sbatch --parsable --nodes=2 --gpus-per-node=0 examples/dapo/run_dapo_qwen2.5_32b.sh \
                  "${JOURNEY_TINY[@]}") || journey_fail "sbatch refused the recipe"
    JOURNEY_OUT=$PWD/megarl-dapo-qwen2.5-32b-$JOURNEY_JOB.out  # the recipe's --output=%x-%j.out
    journey_log "job $JOURNEY_JOB submitted; its output: $JOURNEY_OUT"
    journey_wait 900 "step 1's checkpoint" journey_saved 1
    sbatch --parsable --job-name=urgent --partition=urgent --exclusive --nodes=2 --output="$JOURNEY_WORK/urgent.out" \
        --wrap "sleep 1" > /dev/null
    journey_log "preempted by a job of the partition urgent"
    journey_wait 180 "the run stopped by the preemption" grep -aq "megarl: stopped by SIGTERM" "$JOURNEY_OUT"
    grep -aq "megarl: stopped by SIGTERM; .* the newest checkpoint is step [0-9]* (.*): the same command resumes from it; slurm job $JOURNEY_JOB, if requeued" \
        "$JOURNEY_OUT" || journey_fail "the preempted run does not say where it resumes"
    journey_wait 600 "the requeued job resumed" grep -aq "megarl: resumed from .*(step [0-9]*), slurm job $JOURNEY_JOB restarted 1 time(s) (requeued)" "$JOURNEY_OUT"
    # requeued by ray_on_slurm once the run stopped, or by slurm when the partition's GraceTime ran out first
    grep -aqE "preempted at [0-9T:-]+: requeueing job $JOURNEY_JOB|DUE TO PREEMPTION" "$JOURNEY_OUT" \
        || journey_fail "job $JOURNEY_JOB was not requeued for a preemption"
    journey_wait 900 "the job's end" journey_over
    [[ $(journey_job_state "$JOURNEY_JOB") == COMPLETED ]] || journey_fail "job $JOURNEY_JOB ended $(journey_job_state "$JOURNEY_JOB"); its output ends:
$(tail -n 60 "$JOURNEY_OUT")"
    grep -aq "megarl: MLflow run [0-9a-f]* on $MLFLOW_TRACKING_URI: watch it there" "$JOURNEY_OUT" \
        || journey_fail "the job's output does not say where its MLflow run is"
    "$TEST_PY" "$JOURNEY_TESTS/check_tracking.py" "$MLFLOW_TRACKING_URI" dapo-qwen2.5-32b "$JOURNEY_STEPS" \
        || journey_fail "the MLflow server's record of the run"
    journey_log "job $JOURNEY_JOB: preempted, requeued, resumed and COMPLETED $JOURNEY_STEPS steps in one MLflow run"
}

# 7. `python -m sglang.launch_server --model-path models/Qwen2.5-32B-dapo --tp 8 ...` on GPUs: here
# SGLang's CPU server, as the command without --tp and with the CPU engine's flags; its greedy
# tokens and log-probs checked against HF's of the exported model
journey_instead_serve() {
    "$TEST_PY" "$JOURNEY_TESTS/serve_check.py" "$SGLANG_PY" models/Qwen2.5-32B-dapo \
        || journey_fail "SGLang serving the exported model"
}

# the servers the journey's blocks started in the background (the MLflow server), with the
# processes they started, by their ids; at the journey's end
journey_kill_tree() {
    local child
    for child in $(pgrep -P "$1" || true); do journey_kill_tree "$child"; done
    kill "$1" 2>/dev/null || true
}
journey_stop_servers() {
    local pid
    for pid in $(jobs -p); do journey_kill_tree "$pid"; done
}
