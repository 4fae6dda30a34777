"""Routing replay on an HF mixture of experts (megarl.backends.moe has what it is for).

Forward hooks on the MoE layers' routers replace each router's choice with the replayed
experts: the router's logits are kept, the weights of the replayed experts are their softmax
probabilities (renormalised over the k when the config's norm_topk_prob says so), as HF
computes them for its own choice. Main entry point: `replayed_routing`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of the model's MoE layers, in layer order."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model: the HF one
    return [layer.mlp.gate for layer in inner.model.layers if hasattr(layer.mlp, "experts")]


@contextmanager
def replayed_routing(model: torch.nn.Module, indices: Sequence[torch.Tensor] | None) -> Iterator[None]:
    """Forwards within route each MoE layer's tokens (batch x sequence, flattened) to
    `indices[layer]` ((tokens, k) long, megarl.backends.moe.replay_indices); None: no replay."""
    if indices is None:
        yield
        return
    routers = moe_routers(model)
    if len(routers) != len(indices):
        raise ValueError(f"{len(indices)} layers of routing for a model with {len(routers)} MoE layers")
    handles = [router.register_forward_hook(_replay(idx)) for router, idx in zip(routers, indices)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _replay(idx: torch.Tensor):
    def hook(router, args, output):
        logits = output[0]
        if logits.shape[0] != idx.shape[0]:
            raise ValueError(f"routing replay: {idx.shape[0]} tokens of routing for {logits.shape[0]} tokens")
        chosen = idx.to(logits.device)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, chosen)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), chosen
    return hook
