# The body of the Search-R1 recipes (run_search_r1_qwen2.5_*.sh set SIZE, MODEL_PATH and
# PLAN_MODEL, then source this from the repository root with their arguments).
source tools/ray_on_slurm.sh

DATA_DIR=${DATA_DIR:-data/search_r1}
INDEX_DIR=${INDEX_DIR:-indexes/wiki18_bm25}
ALGO=${ALGO:-dapo}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/search_r1_qwen2.5_${SIZE}_$ALGO}
PLAN_ARGS="--max-prompt-length 4096 --max-response-length 4096 --max-tokens-per-gpu 16384"
extra=()
case $ALGO in
    dapo) ;;
    ppo)  # Search-R1's PPO: one sample per prompt, GAE, critic lr 1e-5, KL loss 0.001, no clip-higher
        PLAN_ARGS="$PLAN_ARGS --critic --kl"
        extra=(algorithm.adv_estimator=gae rollout.n=1 algorithm.clip_ratio_high=0.2
               algorithm.dynamic_sampling.enable=false algorithm.use_kl_loss=true algorithm.kl_loss_coef=0.001
               critic.enable=true critic.backend=megatron critic.optim.lr=1e-5 critic.ppo_mini_batch_size=256
               critic.ppo_micro_batch_size=8 critic.max_tokens_per_gpu=16384) ;;
    *) echo "ALGO=$ALGO: use dapo or ppo" >&2; exit 2 ;;
esac

retrieval_on_slurm "$INDEX_DIR"
megarl_train_on_slurm "examples/search_r1/search_r1_qwen2.5_${SIZE}.yaml" \
    "data.train_files=[$DATA_DIR/train.parquet]" "data.val_files=[$DATA_DIR/test.parquet]" \
    "agent.retrieval.url=$RETRIEVAL_URL" "${extra[@]}" "$@"
