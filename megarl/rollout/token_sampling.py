"""Next-token sampling for the embedded engine: temperature, top-k, top-p, per-request seeds.

Main entry point: `sample_next_tokens`. The returned log-prob of a sampled token follows the
engine convention (megarl.rollout.engine): log softmax(logits / T) before truncation, T = 1
for greedy requests.
"""

from __future__ import annotations

import torch

from megarl.rollout.engine import SamplingParams


def sample_next_tokens(logits: torch.Tensor, params: list[SamplingParams],
                       generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (n, V) float32 -> (tokens (n,), log_probs (n,)), row i sampled with params[i]
    and generators[i] (a seeded request owns its generator, so its samples do not depend on
    which other requests share the batch)."""
    temperatures = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                                dtype=logits.dtype, device=logits.device)
    log_probs = torch.log_softmax(logits / temperatures[:, None], dim=-1)
    tokens = torch.empty(len(params), dtype=torch.long)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature == 0:
            tokens[row] = int(torch.argmax(logits[row]))
        else:
            tokens[row] = _sample_row(log_probs[row], p.top_k, p.top_p, gen)
    chosen = log_probs.gather(-1, tokens.to(logits.device)[:, None]).squeeze(-1)
    return tokens, chosen


def _sample_row(log_probs: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator) -> int:
    probs = log_probs.exp()
    if top_k == -1 and top_p >= 1.0:
        return int(torch.multinomial(probs.cpu(), 1, generator=generator))
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k != -1:
        keep[top_k:] = False
    if top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep &= (sorted_probs.cumsum(0) - sorted_probs) < top_p
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    pick = int(torch.multinomial(kept.cpu(), 1, generator=generator))
    return int(order[pick])
