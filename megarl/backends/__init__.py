"""Train workers: the torch backend (`torch/`, a plain HF model on one device) and the megatron
backend (`megatron/`, one rank of a TP x PP x CP x DP group), both implementing `TrainWorker`
(`base`).

What both backends share lives here, and neither backend imports the other: the batch they
consume (`batch`), the actor's loss (`loss`), PPO epochs over mini-batches (`epochs`), the
learning-rate schedule (`schedule`), host offload of frozen weights (`offload`) and the RNG
states a checkpoint keeps (`rng`).
"""
