"""Context parallelism: every sequence of a micro-batch split over the CP ranks.

A micro-batch padded to length L (a multiple of 2 x CP) is cut into 2 x CP chunks along the
sequence; CP rank r holds chunks r and 2CP - 1 - r, so that under causal attention every
rank has the same amount of work (megatron's load-balanced layout: its rotary embeddings
take the same two chunks of positions on each rank). Attention needs the keys and values of
the whole sequence: Transformer Engine's attention exchanges them around a ring of the CP
ranks; megatron's local layers have no CP path, so `ContextParallelAttention` stands in for
their core attention there and all-gathers the keys and values (memory for the whole
sequence's K and V on every rank, no overlap: for CPU and small runs, and the tests).

Every per-position output then exists on exactly one CP rank: `owned_positions` says which.
Per-token results are summed over the CP group (the other ranks hold zeros there), and a
loss counts only the rank's own tokens with the whole micro-batch's normaliser, so the sum
over CP ranks is the loss of the whole sequence. Main entry points: `owned_positions`,
`ContextParallelAttention`.
"""

from __future__ import annotations

import torch

from megatron.core.transformer.dot_product_attention import DotProductAttention


def owned_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """Positions (in order) of a length-`length` sequence held by CP rank `rank` of `cp`."""
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} positions does not split into 2 x {cp} chunks")
    chunk = length // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over `group`, rank order; backward: each rank's share of the
    gradient summed over the group (every rank's loss used every rank's keys and values)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        size, rank = torch.distributed.get_world_size(ctx.group), torch.distributed.get_rank(ctx.group)
        return grad.chunk(size, 0)[rank], None


class ContextParallelAttention(DotProductAttention):
    """megatron's local core attention under context parallelism: the keys and values of
    the whole sequence all-gathered over the CP group, this rank's queries attending to them
    causally by their positions in the sequence."""

    def __init__(self, config, *args, **kwargs):
        from dataclasses import replace

        from megatron.core import parallel_state

        # the parent refuses CP sizes other than 1; the gathering here is what makes it work
        super().__init__(replace(config, context_parallel_size=1), *args, **kwargs)
        self.cp_group = parallel_state.get_context_parallel_group()
        self.cp = torch.distributed.get_world_size(self.cp_group)
        self.cp_rank = torch.distributed.get_rank(self.cp_group)
        self._mask_of: tuple[tuple[int, str], torch.Tensor] | None = None  # the last one (every layer asks)

    def _positions(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions of this rank's queries, positions of the gathered keys) in the whole row."""
        length = local * self.cp
        return (owned_positions(length, self.cp, self.cp_rank),
                torch.cat([owned_positions(length, self.cp, r) for r in range(self.cp)]))

    def _mask(self, local: int, device) -> torch.Tensor:
        """(1, 1, local, local x CP) bool, True where a query must not see a key (causal)."""
        key = (local, str(device))
        if self._mask_of is None or self._mask_of[0] != key:  # micro-batch widths vary: keep one, not all
            queries, keys = self._positions(local)
            self._mask_of = key, (keys[None, :] > queries[:, None])[None, None].to(device)
        return self._mask_of[1]

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("THD-packed sequences with context parallelism need Transformer Engine")
        if attention_mask is None:
            mask = self._mask(query.shape[0], query.device)
        else:  # the whole row's mask (packed sequences): this rank's queries against the gathered keys
            queries, keys = (p.to(attention_mask.device) for p in self._positions(query.shape[0]))
            mask = attention_mask[:, :, queries][:, :, :, keys]
        key = _GatherSequence.apply(key, self.cp_group)  # [s, b, groups, head dim], s = local x CP
        value = _GatherSequence.apply(value, self.cp_group)
        return super().forward(query, key, value, mask, attn_mask_type, attention_bias, None)
