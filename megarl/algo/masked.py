"""Statistics over the valid tokens of a padded (B, T) batch.

A mask marks the positions that count (1 = response token trained on, 0 = padding or a
retrieved observation token). Masked positions are excluded with `torch.where`, not by
multiplying, so NaN or inf left in padding (e.g. log-probs of pad tokens) cannot leak in.
Main entry point: `masked_whiten`.
"""

from __future__ import annotations

import torch


def zero_outside_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x where m = 1, else exactly 0 (also where x is NaN or inf). Same shape as values."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values over positions where mask is set.

    sum = Σ_{m=1} x, over all elements (dim=None, a scalar) or along `dim`.
    Shapes: values and mask broadcastable to each other; mask is bool or 0/1.
    """
    kept = zero_outside_mask(values, mask)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of values over positions where mask is set.

    mean = Σ_{m=1} x / max(N, 1), N = number of set positions, over all elements
    (dim=None, a scalar) or along `dim`. An empty mask gives 0 rather than NaN, so a
    micro-batch of all-padding rows does not poison metrics.
    Shapes: values and mask broadcastable (usually both (B, T)); mask is bool or 0/1.
    """
    count = masked_sum(torch.ones_like(values), mask, dim)
    return masked_sum(values, mask, dim) / count.clamp_min(1)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased (Bessel-corrected) variance of all valid elements, a scalar.

    var = Σ_{m=1} (x − mean)² / (N − 1); N ≤ 1 gives 0 (a single value has no spread).
    """
    mean = masked_mean(values, mask)
    count = mask.bool().sum()
    return masked_sum((values - mean) ** 2, mask) / (count - 1).clamp_min(1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten over all valid tokens of the batch: zero mean, unit variance.

    out = (x − mean) / sqrt(var + eps) · m, with mean and unbiased var taken over every
    position where m = 1 in the whole (B, T) batch (not per row). Padding stays 0.
    Shapes: values (B, T), mask (B, T) → (B, T), dtype of values.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    return zero_outside_mask(whitened, mask)
