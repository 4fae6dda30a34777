"""megarl: RL post-training of LLMs at scale."""
