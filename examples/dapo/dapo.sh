# The body of the DAPO recipes (run_dapo_qwen2.5_*.sh set SIZE, MODEL_PATH and PLAN_MODEL,
# then source this from the repository root with their arguments).
source tools/ray_on_slurm.sh

DATA_DIR=${DATA_DIR:-data/dapo}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/dapo_qwen2.5_$SIZE}
PLAN_ARGS=${PLAN_ARGS:---max-prompt-length 2048 --max-response-length 20480 --max-tokens-per-gpu 22528}

megarl_train_on_slurm "examples/dapo/dapo_qwen2.5_${SIZE}.yaml" \
    "data.train_files=[$DATA_DIR/dapo-math-17k.parquet]" "data.val_files=[$DATA_DIR/aime-2024.parquet]" "$@"
