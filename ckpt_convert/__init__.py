"""Checkpoint conversion between HF safetensors and megatron distributed checkpoints.

    python -m ckpt_convert.megatron_to_hf --ckpt DIR --out HF_DIR [--hf-config HF_DIR]

The tensor correspondence is megarl.models (one source of truth with loading, export and
weight sync); megarl.backends.megatron.dist_format reads distributed checkpoints tensor by tensor.
"""
