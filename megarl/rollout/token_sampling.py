"""Next-token sampling for the embedded engine: temperature, top-k, top-p, per-request seeds.

Main entry point: `sample_next_tokens`. The returned log-prob of a sampled token follows the
engine convention (megarl.rollout.engine): log softmax(logits / T) before truncation, T = 1
for greedy requests.

Sampling is by inverse CDF over the whole batch at once: each sampled row draws one uniform
number from its own generator (a seeded request's tokens do not depend on which other requests
share its batch), and one cumulative sum and one search pick every row's token. Drawing per
row with torch.multinomial cost as much as the model itself on a small model (a fixed cost
per call, 64 calls per step).
"""

from __future__ import annotations

import torch

from megarl.rollout.engine import SamplingParams


def sample_next_tokens(logits: torch.Tensor, params: list[SamplingParams],
                       generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (n, V) float32 -> (tokens (n,), log_probs (n,)), row i sampled with params[i]
    and generators[i] (CPU generators)."""
    temperatures = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                                dtype=logits.dtype, device=logits.device)
    log_probs = torch.log_softmax(logits / temperatures[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)  # what greedy rows (temperature 0) keep
    sampled = [row for row, p in enumerate(params) if p.temperature > 0]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        # float64: the running sum over a 150k vocabulary stays exact enough that the draw
        # follows the probabilities the returned log-probs state
        probs = log_probs[rows].double().exp()
        for i, row in enumerate(sampled):
            p = params[row]
            if p.top_k != -1 or p.top_p < 1.0:
                probs[i] = truncated(probs[i], p.top_k, p.top_p)
        uniform = torch.cat([torch.rand(1, generator=generators[row], dtype=torch.float64) for row in sampled])
        cdf = probs.cumsum(dim=-1)
        # right=True: the first token whose running sum passes u·total, never one of probability 0
        picks = torch.searchsorted(cdf, (uniform.to(cdf.device) * cdf[:, -1])[:, None], right=True)
        tokens[rows] = picks.squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    chosen = log_probs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.cpu(), chosen


def truncated(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """probs (V,) with all but the top_k most likely tokens and, of those, all but the smallest
    prefix (most likely first) whose mass reaches top_p set to 0 (the most likely always stays)."""
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k != -1:
        keep[top_k:] = False
    if top_p < 1.0:
        keep &= (sorted_probs.cumsum(0) - sorted_probs) < top_p
    kept = torch.zeros_like(keep)
    kept[order[keep]] = True
    return torch.where(kept, probs, torch.zeros_like(probs))
