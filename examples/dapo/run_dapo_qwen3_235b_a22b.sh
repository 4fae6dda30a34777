#!/usr/bin/env bash
#SBATCH --job-name=megarl-dapo-qwen3-235b-a22b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:TERM@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
#
# DAPO on Qwen3-235B-A22B base (a mixture of experts: 128 experts, 8 per token) with the paper's settings (examples/dapo/dapo_qwen3_235b_a22b.yaml):
# 512 prompts x 16 samples, 3x over-generation with dynamic sampling, responses up to 20480
# tokens with a 4096-token overlong buffer, clip 0.2 / 0.28, token-mean loss, lr 1e-6 with
# warm-up, weight decay 0.1, grad clip 1.0; AIME-2024 avg@32 at top_p 0.7. Megatron actor with
# expert parallelism on half of the GPUs, SGLang engines on the other half (MEGARL_ROLLOUT_GPUS, planned
# with --rollout-gpus); the layout is `megarl plan`'s for the nodes of the job.
#
#   megarl data dapo-math --out $MEGARL_DATA_DIR          # once: train and validation parquet
#   sbatch examples/dapo/run_dapo_qwen3_235b_a22b.sh [key=value ...]
#
# Environment (defaults): MEGARL_MODEL_PATH [models/Qwen3-235B-A22B], MEGARL_DATA_DIR [data/dapo],
# MEGARL_OUTPUT_DIR [outputs/dapo_qwen3_235b_a22b], MLFLOW_TRACKING_URI [a store in MEGARL_OUTPUT_DIR],
# MEGARL_NNODES [the job's nodes], MEGARL_GPUS_PER_NODE [8], MEGARL_GPU_MEMORY [80GB], MEGARL_LAYOUT [megarl plan's].
#
# To stop the run cleanly (MLflow status, actors, exit 143; the same command resumes it):
# scancel --batch --signal=TERM JOBID. --signal above does the same 5 minutes before the time
# limit (docs/slurm.md#stopping-a-run).
set -euo pipefail
cd "${MEGARL_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}"

recipe=qwen3_235b_a22b  # examples/dapo/dapo_$recipe.yaml
MEGARL_MODEL_PATH=${MEGARL_MODEL_PATH:-models/Qwen3-235B-A22B}
MEGARL_PLAN_MODEL=${MEGARL_PLAN_MODEL:-Qwen/Qwen3-235B-A22B}
MEGARL_ROLLOUT_GPUS=${MEGARL_ROLLOUT_GPUS:-$(( ${MEGARL_NNODES:-${SLURM_JOB_NUM_NODES:-16}} * ${MEGARL_GPUS_PER_NODE:-8} / 2 ))}
MEGARL_PLAN_ARGS=${MEGARL_PLAN_ARGS:---rollout-gpus $MEGARL_ROLLOUT_GPUS}
source examples/dapo/dapo.sh "$@"
