#!/usr/bin/env bash
#SBATCH --job-name=megarl-search-r1-qwen2.5-32b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:TERM@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
#
# Search-R1 on NQ + HotpotQA with Qwen2.5-32B base (examples/search_r1/search_r1_qwen2.5_32b.yaml):
# multi-turn search rollouts (<search> -> top-3 passages in <information>, masked out of the
# loss -> <answer>), exact-match reward, DAPO; MEGARL_ALGO=ppo trains PPO with a megatron critic, GAE
# and a KL loss instead (Search-R1's PPO settings). The recipe starts the retrieval server on
# the job's last node, then trains with the layout `megarl plan` recommends.
#
#   megarl data search-r1 --out $MEGARL_DATA_DIR --source FLASHRAG_DIR  # once: train / test parquet
#   megarl retrieval build --corpus wiki-18.jsonl --out $MEGARL_INDEX_DIR [--kind dense --encoder e5-base-v2]
#   sbatch examples/search_r1/run_search_r1_qwen2.5_32b.sh [key=value ...]
#
# Environment (defaults): MEGARL_MODEL_PATH [models/Qwen2.5-32B], MEGARL_DATA_DIR [data/search_r1],
# MEGARL_INDEX_DIR [indexes/wiki18_bm25], MEGARL_ALGO [dapo | ppo], MEGARL_OUTPUT_DIR [outputs/search_r1_qwen2.5_32b_$MEGARL_ALGO],
# MLFLOW_TRACKING_URI [a store in MEGARL_OUTPUT_DIR], MEGARL_NNODES [the job's nodes], MEGARL_GPUS_PER_NODE [8],
# MEGARL_GPU_MEMORY [80GB], MEGARL_RETRIEVAL_PORT [8000], MEGARL_RETRIEVAL_ARGS [], MEGARL_LAYOUT [megarl plan's].
#
# To stop the run cleanly (MLflow status, actors, exit 143; the same command resumes it):
# scancel --batch --signal=TERM JOBID. --signal above does the same 5 minutes before the time
# limit (docs/slurm.md#stopping-a-run).
set -euo pipefail
cd "${MEGARL_HOME:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}}"

size=32b  # examples/search_r1/search_r1_qwen2.5_$size.yaml
MEGARL_MODEL_PATH=${MEGARL_MODEL_PATH:-models/Qwen2.5-32B}
MEGARL_PLAN_MODEL=${MEGARL_PLAN_MODEL:-Qwen/Qwen2.5-32B}
source examples/search_r1/search_r1.sh "$@"
