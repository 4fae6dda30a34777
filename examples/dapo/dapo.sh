# The body of the DAPO recipes: run_dapo_*.sh set `recipe` (the config is examples/dapo/dapo_$recipe.yaml),
# MEGARL_MODEL_PATH and MEGARL_PLAN_MODEL, then source this from the repository root with their arguments.
source tools/ray_on_slurm.sh

MEGARL_DATA_DIR=${MEGARL_DATA_DIR:-data/dapo}
MEGARL_OUTPUT_DIR=${MEGARL_OUTPUT_DIR:-outputs/dapo_$recipe}

megarl_train_on_slurm "examples/dapo/dapo_${recipe}.yaml" \
    "data.train_files=[$MEGARL_DATA_DIR/dapo-math-17k.parquet]" "data.val_files=[$MEGARL_DATA_DIR/aime-2024.parquet]" "$@"
