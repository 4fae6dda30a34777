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

Routing replay (`actor.moe_routing_replay`): the trainer's forwards route each token to the
experts the rollout engine routed it to (`TrainBatch.routed_experts`), so old and new log-probs
are computed under the rollout's routing; the router's weights still get gradients, through
the probabilities of the replayed experts. The load-balancing loss keeps the router's own top
k, as megatron's does under replay.

Main entry points: `load_balancing_loss`, `load_max_over_mean`, `replay_indices`.
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


def replay_indices(routed: torch.Tensor, topk: int, moe_layers: Sequence[int], num_layers: int) -> list[torch.Tensor]:
    """Each MoE layer's (tokens, k) long expert indices from `routed`, (..., width) int in the
    tokens' order (TrainBatch.routed_experts, flattened as the model flattens its tokens).
    width is the MoE layers x k, or all `num_layers` x k (an engine that reports dense layers
    too: their rows are skipped). Positions without routing (-1: padding, a sequence's last
    token) get experts 0 .. k - 1, whose outputs no trained log-prob depends on."""
    width = routed.shape[-1]
    if width == len(moe_layers) * topk:
        layers = range(len(moe_layers))
    elif width == num_layers * topk:
        layers = moe_layers
    else:
        raise ValueError(f"routed experts of width {width}: expected the {len(moe_layers)} MoE layers x top-{topk} "
                         f"({len(moe_layers) * topk}) or all {num_layers} layers x top-{topk}; "
                         "was the rollout engine's model this one?")
    flat = routed.reshape(-1, width // topk, topk).long()
    fill = torch.arange(topk, device=flat.device).expand(flat.shape[0], topk)
    out = []
    for layer in layers:
        idx = flat[:, layer]
        out.append(torch.where(idx[:, :1] < 0, fill, idx))
    return out
