"""The batch that train workers consume: prompt + response token rows and per-token fields.

Every per-token tensor is (B, L) and aligned with `input_ids`: position t holds the
quantity of token t (its log-prob given tokens < t, its advantage, ...). `loss_mask` is 1
on the response tokens the model sampled (0 on prompt, padding and retrieved
observations). `routed_experts` (routing replay) holds, per row, the experts each token was
routed to when the rollout engine read it, unpadded (`RaggedRows`: a token's row is MoE layers
x top-k wide, 192 times an fp32 field's bytes for Qwen3-30B-A3B, so it is padded per
micro-batch only).
Main entry point: `TrainBatch.from_sequences`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

PER_TOKEN_FIELDS = ("old_log_probs", "ref_log_probs", "rollout_log_probs", "advantages", "returns", "values")


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # (B, L) long, right-padded
    attention_mask: torch.Tensor  # (B, L) 1 on real tokens
    loss_mask: torch.Tensor  # (B, L) 1 on sampled response tokens
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    values: torch.Tensor | None = None
    routed_experts: RaggedRows | None = None  # row i: (tokens of row i - 1, width) int16

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def from_sequences(cls, prompts: list[list[int]], responses: list[list[int]], response_masks: list[list[int]],
                       pad_id: int = 0, rollout_log_probs: list[list[float]] | None = None,
                       routed_experts: list[torch.Tensor | None] | None = None) -> TrainBatch:
        """Rows prompt + response, right-padded to the longest row. `routed_experts[row]`:
        (prompt + response - 1, width), the experts of every token but the last."""
        if not (len(prompts) == len(responses) == len(response_masks)):
            raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses, {len(response_masks)} masks")
        width = max(len(p) + len(r) for p, r in zip(prompts, responses))
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        loss_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        rollout = torch.zeros((len(prompts), width)) if rollout_log_probs is not None else None
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        routed = routing_rows(routed_experts, lengths) if routed_experts is not None else None
        for row, (p, r, m) in enumerate(zip(prompts, responses, response_masks)):
            if len(m) != len(r):
                raise ValueError(f"row {row}: response of {len(r)} tokens but a mask of {len(m)}")
            if not p:
                raise ValueError(f"row {row}: empty prompt (the first response token needs a context)")
            n = len(p) + len(r)
            ids[row, :n] = torch.tensor(p + r)
            attention[row, :n] = 1
            loss_mask[row, len(p):n] = torch.tensor(m, dtype=torch.long)
            if rollout is not None:
                rollout[row, len(p):n] = torch.tensor(rollout_log_probs[row])
        return cls(ids, attention, loss_mask, rollout_log_probs=rollout, routed_experts=routed)

    def select(self, index: torch.Tensor | slice) -> TrainBatch:
        """The rows at `index` (every field sliced alike)."""
        return replace(self, **{f.name: (getattr(self, f.name)[index] if getattr(self, f.name) is not None else None)
                                for f in fields(self)})

    def cut(self, width: int) -> TrainBatch:
        """The first `width` columns of every per-token tensor (rows are right-padded, so
        columns past the longest row hold padding only)."""
        return replace(self, **{f.name: (getattr(self, f.name)[:, :width] if isinstance(getattr(self, f.name), torch.Tensor)
                                         else getattr(self, f.name)) for f in fields(self)})

    def routing(self) -> torch.Tensor | None:
        """(B, L, width) the routed experts padded as the rows are (-1: padding and each row's
        last token, which is never an engine's input), or None."""
        return None if self.routed_experts is None else self.routed_experts.padded(self.input_ids.shape[1])

    def with_fields(self, **values: torch.Tensor) -> TrainBatch:
        unknown = set(values) - set(PER_TOKEN_FIELDS)
        if unknown:
            raise KeyError(f"unknown TrainBatch fields {sorted(unknown)}; valid: {PER_TOKEN_FIELDS}")
        return replace(self, **values)


@dataclass(frozen=True)
class RaggedRows:
    """Per-row tensors of different lengths, (length of row i, width) each; indexed by rows
    like a tensor field."""

    rows: tuple[torch.Tensor, ...]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: torch.Tensor | slice) -> RaggedRows:
        if isinstance(index, slice):
            return RaggedRows(self.rows[index])
        return RaggedRows(tuple(self.rows[i] for i in torch.as_tensor(index).flatten().tolist()))

    def padded(self, length: int, fill: int = -1) -> torch.Tensor:
        """(rows, length, width), each row's entries first, `fill` after."""
        width = self.rows[0].shape[-1] if self.rows else 0
        out = torch.full((len(self.rows), length, width), fill, dtype=torch.int16)
        for i, row in enumerate(self.rows):
            out[i, : min(len(row), length)] = row[:length]
        return out


def routing_rows(routed: list[torch.Tensor | None], lengths: list[int]) -> RaggedRows:
    """The rows' routing, checked against the rows' `lengths`; int16, each row's tensor itself
    where it is int16 already (no copy)."""
    check_routing(routed, lengths)
    return RaggedRows(tuple(r.to(torch.int16) for r in routed))


def check_routing(routed: list[torch.Tensor | None], lengths: list[int]) -> None:
    """Every row has the engine's routing, one width, for each of its positions but the last."""
    widths = {r.shape[-1] for r in routed if r is not None}
    if len(widths) != 1 or any(r is None for r in routed):
        missing = [i for i, r in enumerate(routed) if r is None]
        raise ValueError(f"routed experts missing for rows {missing[:8]} (or of widths {sorted(widths)}): "
                         "routing replay needs the engine's routing of every sample (SGLang: started with "
                         "--enable-return-routed-experts, which megarl adds with actor.moe_routing_replay)")
    for row, (experts, n) in enumerate(zip(routed, lengths)):
        if experts.shape[0] != n - 1:
            raise ValueError(f"row {row}: routed experts for {experts.shape[0]} positions, expected {n - 1} "
                             "(every token but the last)")
