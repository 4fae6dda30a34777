# The body of the Search-R1 recipes (run_search_r1_qwen2.5_*.sh set `size`, MEGARL_MODEL_PATH and
# MEGARL_PLAN_MODEL, then source this from the repository root with their arguments).
source tools/ray_on_slurm.sh

MEGARL_DATA_DIR=${MEGARL_DATA_DIR:-data/search_r1}
MEGARL_INDEX_DIR=${MEGARL_INDEX_DIR:-indexes/wiki18_bm25}
MEGARL_ALGO=${MEGARL_ALGO:-dapo}
MEGARL_OUTPUT_DIR=${MEGARL_OUTPUT_DIR:-outputs/search_r1_qwen2.5_${size}_$MEGARL_ALGO}
extra=()
case $MEGARL_ALGO in
    dapo) ;;
    ppo)  # Search-R1's PPO: one sample per prompt, GAE, critic lr 1e-5, KL loss 0.001, no clip-higher
        extra=(algorithm.adv_estimator=gae rollout.n=1 algorithm.clip_ratio_high=0.2
               algorithm.dynamic_sampling.enable=false algorithm.use_kl_loss=true algorithm.kl_loss_coef=0.001
               critic.enable=true critic.backend=megatron critic.optim.lr=1e-5 critic.ppo_mini_batch_size=256
               critic.ppo_micro_batch_size=8 critic.max_tokens_per_gpu=16384) ;;
    *) echo "MEGARL_ALGO=$MEGARL_ALGO: use dapo or ppo" >&2; exit 2 ;;
esac

retrieval_on_slurm "$MEGARL_INDEX_DIR"
megarl_train_on_slurm "examples/search_r1/search_r1_qwen2.5_${size}.yaml" \
    "data.train_files=[$MEGARL_DATA_DIR/train.parquet]" "data.val_files=[$MEGARL_DATA_DIR/test.parquet]" \
    "agent.retrieval.url=$MEGARL_RETRIEVAL_URL" "${extra[@]}" "$@"
