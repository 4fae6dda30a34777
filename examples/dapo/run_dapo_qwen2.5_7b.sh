#!/usr/bin/env bash
#SBATCH --job-name=megarl-dapo-qwen2.5-7b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:TERM@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
#
# DAPO on Qwen2.5-7B base with the paper's settings (examples/dapo/dapo_qwen2.5_7b.yaml):
# 512 prompts x 16 samples, 3x over-generation with dynamic sampling, responses up to 20480
# tokens with a 4096-token overlong buffer, clip 0.2 / 0.28, token-mean loss, lr 1e-6 with
# warm-up, weight decay 0.1, grad clip 1.0; AIME-2024 avg@32 at top_p 0.7. Megatron actor and
# SGLang engines colocated; the layout is `megarl plan`'s for the nodes of the job.
#
#   megarl data dapo-math --out $MEGARL_DATA_DIR          # once: train and validation parquet
#   sbatch examples/dapo/run_dapo_qwen2.5_7b.sh [key=value ...]
#
# Environment (defaults): MEGARL_MODEL_PATH [models/Qwen2.5-7B], MEGARL_DATA_DIR [data/dapo],
# MEGARL_OUTPUT_DIR [outputs/dapo_qwen2.5_7b], MLFLOW_TRACKING_URI [a store in MEGARL_OUTPUT_DIR],
# MEGARL_NNODES [the job's nodes], MEGARL_GPUS_PER_NODE [8], MEGARL_GPU_MEMORY [80GB], MEGARL_LAYOUT [megarl plan's].
#
# To stop the run cleanly (MLflow status, actors, exit 143; the same command resumes it):
# scancel --batch --signal=TERM JOBID. --signal above does the same 5 minutes before the time
# limit (docs/slurm.md#stopping-a-run).
set -euo pipefail
cd "${MEGARL_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}"

recipe=qwen2.5_7b  # examples/dapo/dapo_$recipe.yaml
MEGARL_MODEL_PATH=${MEGARL_MODEL_PATH:-models/Qwen2.5-7B}
MEGARL_PLAN_MODEL=${MEGARL_PLAN_MODEL:-Qwen/Qwen2.5-7B}
source examples/dapo/dapo.sh "$@"
