#!/usr/bin/env bash
#SBATCH --job-name=megarl-quickstart
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=01:00:00
#SBATCH --signal=B:TERM@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=megarl-quickstart-%j.out
#
# The CPU quickstart (Search-R1 + DAPO on a tiny model) as a slurm job on one node, run the
# way the GPU recipes run: a Ray cluster on the allocation (tools/ray_on_slurm.sh), then
# `megarl train` joining it. Submit from the repository root after `make setup`:
#
#   sbatch examples/quickstart/run_quickstart.sh [key=value ...]
#
# Environment (defaults in brackets): MEGARL_QUICKSTART [search; or math: single-turn DAPO on sums],
# MEGARL_DATA_DIR [outputs/quickstart or outputs/quickstart_math] built by `python -m megarl.quickstart
# prepare` (prepare-math) when missing, with MEGARL_PREPARE_ARGS, MEGARL_OUTPUT_DIR [MEGARL_DATA_DIR/run_slurm],
# MLFLOW_TRACKING_URI [a store inside MEGARL_OUTPUT_DIR], MEGARL_RAY_NUM_CPUS [8 scheduling slots].
#
# To stop the run cleanly (MLflow status, actors, exit 143; the same command resumes it):
# scancel --batch --signal=TERM JOBID. --signal above does the same 5 minutes before the time
# limit (docs/slurm.md#stopping-a-run).
set -euo pipefail
cd "${MEGARL_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}"
source tools/ray_on_slurm.sh

megarl_install && _megarl_needs megarl || exit 2
PY=$MEGARL_PY
case ${MEGARL_QUICKSTART:-search} in
    search) config=examples/quickstart/search_r1_tiny.yaml; prepare=prepare; MEGARL_DATA_DIR=${MEGARL_DATA_DIR:-outputs/quickstart} ;;
    math) config=examples/quickstart/dapo_math_tiny.yaml; prepare=prepare-math
          MEGARL_DATA_DIR=${MEGARL_DATA_DIR:-outputs/quickstart_math} ;;
    *) echo "MEGARL_QUICKSTART=$MEGARL_QUICKSTART: use search or math" >&2; exit 2 ;;
esac
MEGARL_OUTPUT_DIR=${MEGARL_OUTPUT_DIR:-$MEGARL_DATA_DIR/run_slurm}
export MEGARL_RAY_NUM_CPUS=${MEGARL_RAY_NUM_CPUS:-8}  # logical slots for the run's actors, not cores

# shellcheck disable=SC2086
"$PY" -m megarl.quickstart $prepare "$MEGARL_DATA_DIR" ${MEGARL_PREPARE_ARGS:-}

args=(train "$config"
      "model.path=$MEGARL_DATA_DIR/model"
      "data.train_files=[$MEGARL_DATA_DIR/data/train.parquet]" "data.val_files=[$MEGARL_DATA_DIR/data/val.parquet]"
      "trainer.output_dir=$MEGARL_OUTPUT_DIR" "cluster.ray_address=auto" "cluster.nnodes=${SLURM_JOB_NUM_NODES:-1}")
[[ $prepare == prepare ]] && args+=("agent.retrieval.index_dir=$MEGARL_DATA_DIR/index")
[[ -n "${MLFLOW_TRACKING_URI:-}" ]] && args+=("tracking.uri=$MLFLOW_TRACKING_URI")
echo "megarl quickstart on slurm job ${SLURM_JOB_ID:-?}: $MEGARL_CMD ${args[*]} $*"
ray_on_slurm "$MEGARL_CMD" "${args[@]}" "$@"
