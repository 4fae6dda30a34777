"""The load-balancing loss of a mixture of experts, as both backends train it.

megatron's "aux_loss" (Switch Transformer's), which the megatron backend gets from megatron's
router and the torch backend computes here from the HF model's router logits, so that one
optimizer step is the same on both: for each MoE layer, over the real tokens of one
micro-batch (padding excluded),

    loss = coeff * E / (k * T^2) * sum_i (sum_x p(x, i)) * n_i

with p the softmax over all E experts, n_i the tokens routed to expert i among their top k,
and T the tokens; the layers' losses add up, and a step's gradient takes the mean over its
micro-batches (megatron scales each by 1 / micro-batches, and averages over data parallelism).
It depends on how a mini-batch is split into micro-batches, as megatron's does. HF's own
`load_balancing_loss_func` is k times larger at the same coefficient.

Main entry points: `load_balancing_loss`, `load_max_over_mean`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def routed_counts(router_logits: Sequence[torch.Tensor], real: torch.Tensor, topk: int) -> torch.Tensor:
    """(layers, E) tokens routed to each expert among the real tokens (`real`: bool, flattened
    in the logits' row order)."""
    counts = []
    for logits in router_logits:
        chosen = torch.topk(logits[real].float(), topk, dim=-1).indices
        counts.append(torch.bincount(chosen.reshape(-1), minlength=logits.shape[-1]))
    return torch.stack(counts)


def load_balancing_loss(router_logits: Sequence[torch.Tensor], real: torch.Tensor, topk: int,
                        coeff: float) -> torch.Tensor:
    """The micro-batch's loss summed over its MoE layers (see the module docstring)."""
    counts = routed_counts(router_logits, real, topk)
    total = router_logits[0].new_zeros((), dtype=torch.float32)
    for logits, n in zip(router_logits, counts):
        probs = torch.softmax(logits[real].float(), dim=-1)
        tokens, experts = probs.shape
        if tokens:
            total = total + coeff * experts / (topk * tokens * tokens) * (probs.sum(0) * n).sum()
    return total


def load_max_over_mean(counts: torch.Tensor) -> float:
    """The most loaded expert's tokens over the mean, averaged over the layers (1.0 = balanced)."""
    counts = counts.float()
    mean = counts.mean(dim=-1).clamp_min(1e-9)
    return float((counts.max(dim=-1).values / mean).mean())
