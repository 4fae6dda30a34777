"""DAPO dynamic sampling: keep only prompt groups that carry a learning signal.

A group whose samples all got the same metric (all correct or all wrong) has zero
advantage under GRPO-style estimators and only dilutes the batch. Such groups are
dropped and generation continues until `train_batch_size` informative groups are kept.
Main entry points: `informative_group_mask` (one batch) and `InformativeGroupBuffer` (the
refill loop across generation batches).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from megarl.algo.groups import GroupIds, group_index, group_sizes


class DynamicSamplingError(RuntimeError):
    """Too few informative groups after the allowed number of generation batches."""


def informative_group_mask(group_ids: GroupIds, metric: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Which samples belong to a group worth training on, BoolTensor (B,).

    keep_i = (max_g metric ≠ min_g metric) or n_g = 1, g the group of sample i
    (max ≠ min is std_g > 0 without the rounding of a computed std). Single-sample groups
    are kept: there is no spread to judge them by, so they are not dropped.
    group_ids: LongTensor (B,) or B hashables; metric: (B,) per-sample value (acc, score).
    """
    values = torch.as_tensor(metric, dtype=torch.float64)
    index, num_groups = group_index(group_ids, device=values.device)
    if index.numel() != values.numel():
        raise ValueError(f"got {index.numel()} group ids but {values.numel()} metric values; need one per sample")
    group_max = torch.full((num_groups,), -torch.inf, dtype=values.dtype, device=values.device)
    group_max = group_max.scatter_reduce(0, index, values, "amax")
    group_min = torch.full((num_groups,), torch.inf, dtype=values.dtype, device=values.device)
    group_min = group_min.scatter_reduce(0, index, values, "amin")
    informative = (group_max != group_min) | (group_sizes(index, num_groups) == 1)
    return informative[index]


class InformativeGroupBuffer:
    """Accumulates informative groups over generation batches until a train batch is full.

    Each `add` filters one generation batch with `informative_group_mask` and appends the
    kept groups in order of first appearance, members of a group kept together (even if
    interleaved in the input). `take` returns the samples of the earliest
    `train_batch_size` kept groups — extra groups of the last batch are dropped, as in
    DAPO — and empties the buffer for the next step. Group ids are only compared within
    one `add` call. Samples are any Python objects.

    train_batch_size: groups (prompts) per training step. max_num_gen_batches: generation
    batches allowed per step before `add` raises DynamicSamplingError; 0 = unlimited.
    """

    def __init__(self, train_batch_size: int, max_num_gen_batches: int = 0):
        if train_batch_size <= 0:
            raise ValueError(f"train_batch_size={train_batch_size} must be a positive number of groups")
        if max_num_gen_batches < 0:
            raise ValueError(f"max_num_gen_batches={max_num_gen_batches} must be >= 0 (0 = unlimited)")
        self.train_batch_size = train_batch_size
        self.max_num_gen_batches = max_num_gen_batches
        self._reset()

    def _reset(self) -> None:
        self._kept_groups: list[list[Any]] = []
        self.num_gen_batches = 0
        self.num_generated_groups = 0

    @property
    def num_kept_groups(self) -> int:
        return len(self._kept_groups)

    @property
    def is_full(self) -> bool:
        return self.num_kept_groups >= self.train_batch_size

    def add(
        self, samples: Sequence[Any], group_ids: Sequence[Hashable], metric: torch.Tensor | Sequence[float]
    ) -> None:
        """Filter one generation batch and keep its informative groups.

        Raises DynamicSamplingError when this batch reaches max_num_gen_batches and the
        train batch is still not full.
        """
        if not len(samples) == len(group_ids) == len(metric):
            raise ValueError(
                f"samples, group_ids and metric must have one entry per sample; "
                f"got {len(samples)}, {len(group_ids)}, {len(metric)}"
            )
        if isinstance(group_ids, torch.Tensor):
            group_ids = group_ids.tolist()  # 0-d tensors hash by identity, not by value
        keep = informative_group_mask(group_ids, metric).tolist()
        groups_in_arrival_order: dict[Hashable, list[Any]] = {}
        for sample, group_id, kept in zip(samples, group_ids, keep):
            members = groups_in_arrival_order.setdefault(group_id, [])
            if kept:
                members.append(sample)
        self._kept_groups.extend(members for members in groups_in_arrival_order.values() if members)
        self.num_generated_groups += len(groups_in_arrival_order)
        self.num_gen_batches += 1
        out_of_batches = 0 < self.max_num_gen_batches <= self.num_gen_batches
        if out_of_batches and not self.is_full:
            raise DynamicSamplingError(
                f"dynamic sampling kept {self.num_kept_groups} of {self.num_generated_groups} generated groups "
                f"after {self.num_gen_batches} generation batches, short of train_batch_size="
                f"{self.train_batch_size} groups: too many groups have a constant metric (all solved or all "
                "failed). Use easier data (harder if most groups are all solved) or a larger generation batch "
                "(data.gen_batch_size), or set "
                "algorithm.dynamic_sampling.max_num_gen_batches=0 to keep generating without limit."
            )

    def take(self) -> list[Any]:
        """Samples of the earliest train_batch_size kept groups, flattened group by group; resets."""
        if not self.is_full:
            raise ValueError(
                f"take() needs {self.train_batch_size} kept groups but only {self.num_kept_groups} are kept; "
                "add() more generation batches until is_full"
            )
        batch = [sample for members in self._kept_groups[: self.train_batch_size] for sample in members]
        self._reset()
        return batch
