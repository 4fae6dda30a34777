"""Log-probs and entropy of target tokens from vocabulary-parallel logits.

Each TP rank holds logits for its slice of the (padded) vocabulary; no rank ever builds
full-vocabulary logits. Entries at or beyond the real vocabulary (megatron's padding) are
excluded. The reductions across the TP group are autograd-aware (megatron's
`reduce_from_tensor_model_parallel_region`: all-reduce forward, identity backward), so the
results can be trained through.

For local logits z_r (rank r), temperature T and target y:
    m = max over all ranks of z/T            (no gradient needed: it cancels)
    log Z = m + log Σ_r Σ_v exp(z_rv/T - m)
    log p(y) = z_y/T - log Z                 (z_y lives on exactly one rank)
    entropy = log Z - Σ_v p_v z_v/T
"""

from __future__ import annotations

import torch


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, *,
                             temperature: float = 1.0, with_entropy: bool = False, group=None):
    """(log_probs, entropy or None) of `targets` (B, S) given this rank's logits (B, S, V_local)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group = group if group is not None else parallel_state.get_tensor_model_parallel_group()
    rank, local = torch.distributed.get_rank(group), logits.shape[-1]
    start = rank * local
    z = logits.float() / temperature
    valid = torch.arange(start, start + local, device=z.device) < vocab_size
    z = z.masked_fill(~valid, float("-inf"))

    m = z.detach().amax(dim=-1)
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = z - m.unsqueeze(-1)
    exp = shifted.exp()
    log_z = m + reduce_from_tensor_model_parallel_region(exp.sum(-1)).log()

    mine = (targets >= start) & (targets < start + local)
    local_index = (targets - start).clamp(0, local - 1)
    picked = z.gather(-1, local_index.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
    log_probs = reduce_from_tensor_model_parallel_region(picked) - log_z
    if not with_entropy:
        return log_probs, None
    p = torch.exp(z - log_z.unsqueeze(-1))  # 0 on padded entries
    expected = reduce_from_tensor_model_parallel_region((p * z.masked_fill(~valid, 0.0)).sum(-1))
    return log_probs, log_z - expected
