"""Train workers: the torch backend (plain HF model) and, later, the megatron backend."""
