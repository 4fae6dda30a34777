"""The actor's loss for one micro-batch, shared by the torch and megatron backends.

Given the micro-batch's log-probs and entropy under the current weights, it combines the
policy loss algorithm.policy_loss names (megarl.algo.registry), the optional entropy bonus
and the optional KL loss, each aggregated with the counts of the whole mini-batch (`counts`:
num_tokens, num_seqs, norm_length), so the gradient does not depend on how the mini-batch is
split. Main entry point: `actor_loss`.
"""

from __future__ import annotations

import torch

from megarl.algo import agg_loss, kl_penalty, masked_mean, policy_loss_function
from megarl.backends.batch import TrainBatch
from megarl.config import AlgorithmConfig


def actor_loss(log_probs: torch.Tensor, entropy: torch.Tensor, micro: TrainBatch, algo: AlgorithmConfig,
               counts: dict) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss, metrics) of `micro`; its per-token fields are moved to log_probs' device."""
    a, device = algo, log_probs.device
    mask = micro.loss_mask.to(device)
    rollout = micro.rollout_log_probs
    loss, metrics = policy_loss_function(a.policy_loss)(
        log_probs, micro.old_log_probs.to(device), micro.advantages.to(device), mask, a,
        rollout_log_prob=None if rollout is None else rollout.to(device), **counts)
    if a.entropy_coeff:
        loss = loss - a.entropy_coeff * agg_loss(entropy, mask, a.loss_agg_mode, **counts)
    if a.use_kl_loss:
        kl = kl_penalty(log_probs, micro.ref_log_probs.to(device), a.kl_loss_type)
        loss = loss + a.kl_loss_coef * agg_loss(kl, mask, a.loss_agg_mode, **counts)
        metrics["kl_loss"] = float(masked_mean(kl.detach(), mask))
    metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
    return loss, metrics
