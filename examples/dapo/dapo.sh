# The body of the DAPO recipes (run_dapo_*.sh set NAME, the config's examples/dapo/dapo_$NAME.yaml,
# or SIZE for Qwen2.5, MODEL_PATH and PLAN_MODEL, then source this from the repository root with
# their arguments).
source tools/ray_on_slurm.sh

DATA_DIR=${DATA_DIR:-data/dapo}
NAME=${NAME:-qwen2.5_$SIZE}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/dapo_$NAME}
PLAN_ARGS=${PLAN_ARGS:---max-prompt-length 2048 --max-response-length 20480 --max-tokens-per-gpu 22528}

megarl_train_on_slurm "examples/dapo/dapo_${NAME}.yaml" \
    "data.train_files=[$DATA_DIR/dapo-math-17k.parquet]" "data.val_files=[$DATA_DIR/aime-2024.parquet]" "$@"
