"""Per-token log-probs and entropy of a causal LM over a `TrainBatch`-shaped row block.

Log-probs follow the rollout engines' convention (megarl.rollout.engine): log softmax of
logits / T, T the sampling temperature, so trainer and engine compare like with like.
Main entry point: `token_log_probs`.
"""

from __future__ import annotations

import torch

from megarl.algo import entropy_from_logits


def token_log_probs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    temperature: float = 1.0, with_entropy: bool = False, router_logits: list | None = None):
    """(log_probs, entropy or None), each (B, L): entry t is for token t given tokens < t;
    entry 0 (no context) is 0. Right padding is harmless: causal attention never lets a
    real token see the padding after it. A mixture of experts appends each MoE layer's router
    logits (B * L, experts) to `router_logits` when one is given."""
    kw = {"output_router_logits": True} if router_logits is not None else {}
    out = model(input_ids=input_ids, attention_mask=attention_mask, **kw)
    if router_logits is not None:
        router_logits.extend(out.router_logits or ())
    logits = out.logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    zero = torch.zeros_like(log_probs[:, :1])
    log_probs = torch.cat([zero, log_probs], dim=1)
    if not with_entropy:
        return log_probs, None
    return log_probs, torch.cat([zero, entropy_from_logits(logits)], dim=1)
