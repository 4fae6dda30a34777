#!/usr/bin/env bash
#SBATCH --job-name=megarl-quickstart
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=01:00:00
#SBATCH --output=megarl-quickstart-%j.out
#
# The CPU quickstart (Search-R1 + DAPO on a tiny model) as a slurm job on one node, run the
# way the GPU recipes run: a Ray cluster on the allocation (tools/ray_on_slurm.sh), then
# `megarl train` joining it. Submit from the repository root after `make setup`:
#
#   sbatch examples/quickstart/run_quickstart.sh [key=value ...]
#
# Environment (defaults in brackets): DATA_DIR [outputs/quickstart] built by
# `python -m megarl.quickstart prepare` when missing (PREPARE_ARGS are passed to it),
# CONFIG [examples/quickstart/search_r1_tiny.yaml], OUTPUT_DIR [outputs/quickstart/run_slurm],
# MLFLOW_TRACKING_URI [a store inside OUTPUT_DIR], RAY_NUM_CPUS [8 scheduling slots].
set -euo pipefail
cd "${MEGARL_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}"
source tools/ray_on_slurm.sh

PY=${MEGARL_PYTHON:-.venv/bin/python}
DATA_DIR=${DATA_DIR:-outputs/quickstart}
CONFIG=${CONFIG:-examples/quickstart/search_r1_tiny.yaml}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/quickstart/run_slurm}
export RAY_NUM_CPUS=${RAY_NUM_CPUS:-8}  # logical slots for the run's actors, not cores

# shellcheck disable=SC2086
"$PY" -m megarl.quickstart prepare "$DATA_DIR" ${PREPARE_ARGS:-}

args=(train "$CONFIG"
      "model.path=$DATA_DIR/model"
      "data.train_files=[$DATA_DIR/data/train.parquet]" "data.val_files=[$DATA_DIR/data/val.parquet]"
      "agent.retrieval.index_dir=$DATA_DIR/index"
      "trainer.output_dir=$OUTPUT_DIR" "cluster.ray_address=auto" "cluster.nnodes=${SLURM_JOB_NUM_NODES:-1}")
[[ -n "${MLFLOW_TRACKING_URI:-}" ]] && args+=("tracking.uri=$MLFLOW_TRACKING_URI")
echo "megarl quickstart on slurm job ${SLURM_JOB_ID:-?}: $(dirname "$PY")/megarl ${args[*]} $*"
ray_on_slurm "$(dirname "$PY")/megarl" "${args[@]}" "$@"
