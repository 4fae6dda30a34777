"""Prompt groups: the n samples drawn for one prompt share a group id (a uid).

`group_index` turns any group ids into dense indices 0..G−1, in order of first
appearance, so that per-group statistics are single `index_add_` / `scatter_reduce`
calls instead of a Python loop over groups. Groups may be uneven and interleaved.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

GroupIds = torch.Tensor | Sequence[Hashable]


def group_index(group_ids: GroupIds, device: torch.device | str | None = None) -> tuple[torch.Tensor, int]:
    """Dense group index of each sample and the number of groups.

    index[i] = k when sample i belongs to the k-th distinct id in order of first
    appearance (so index[0] = 0). Ids are an integer tensor (B,) or a sequence of
    hashables (uid strings, ints, tuples). Returns (LongTensor (B,), G).
    """
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be one id per sample, shape (B,); got shape {tuple(group_ids.shape)}")
        unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
        num_groups = unique_ids.numel()
        positions = torch.arange(inverse.numel(), device=inverse.device)
        first_position = torch.full((num_groups,), inverse.numel(), dtype=torch.long, device=inverse.device)
        first_position.scatter_reduce_(0, inverse, positions, reduce="amin")
        # torch.unique numbers groups in sorted-id order; renumber them by first appearance
        rank = torch.empty_like(first_position)
        rank[torch.argsort(first_position)] = torch.arange(num_groups, device=inverse.device)
        index = rank[inverse]
        return (index if device is None else index.to(device)), num_groups
    dense: dict[Hashable, int] = {}
    index_list = [dense.setdefault(group_id, len(dense)) for group_id in group_ids]
    return torch.tensor(index_list, dtype=torch.long, device=device), len(dense)


def group_sizes(index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """n_g = number of samples in each group, LongTensor (G,)."""
    return torch.bincount(index, minlength=num_groups)


def group_sum(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """S_g = Σ_{i in g} x_i, shape (G,), dtype of values."""
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return sums.index_add_(0, index, values)


def group_mean_std(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample group mean and Bessel-corrected group std, each shape (B,).

    mean_g = S_g / n_g;  std_g = sqrt(Σ_{i in g} (x_i − mean_g)² / (n_g − 1)).
    Two passes (subtract the mean, then square) to avoid the cancellation of E[x²] − E[x]².
    Size-1 groups get std 0 here; estimators decide what a lone sample means.
    """
    sizes = group_sizes(index, num_groups).to(values.dtype)
    mean = (group_sum(values, index, num_groups) / sizes.clamp_min(1))[index]
    sq_dev = group_sum((values - mean) ** 2, index, num_groups)
    std = torch.sqrt(sq_dev / (sizes - 1).clamp_min(1))[index]
    return mean, std
