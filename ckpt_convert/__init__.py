"""Checkpoint conversion between HF safetensors and megatron distributed checkpoints: the
library behind `megarl convert` (megarl.convert_command), which is how it is run.

The tensor correspondence is megarl.models (one source of truth with loading, export and
weight sync); megarl.backends.megatron.dist_format reads distributed checkpoints tensor by tensor.
"""
