"""The step's batch as the driver holds it and sends it: rows end to end, no padding.

A step at a recipe's size is thousands of rows of very different lengths (DAPO's responses run
from a few hundred tokens to 20,480). Padded to the longest row, as a worker's `TrainBatch` is,
its per-token tensors would hold several times the tokens. `PackedBatch` keeps each per-token
field as one 1-D tensor over every row's tokens (ids int32, loss mask bool, float fields
float32) and each row's length; a worker pads only the rows it works on (`padded`).

`DataShare` is what one data-parallel rank is sent: its rows, and for an update the sizes of the
whole mini-batches its loss is normalised by (`update_shares`, `forward_shares`). A rank is sent
its share, not the batch.
Main entry points: `PackedBatch.from_sequences`, `update_shares`, `forward_shares`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from megarl.backends.batch import PER_TOKEN_FIELDS, RaggedRows, TrainBatch, routing_rows


@dataclass
class PackedBatch:
    lengths: torch.Tensor  # (B,) int64: each row's tokens (prompt + response)
    input_ids: torch.Tensor  # (N,) int32: the rows end to end, N = lengths.sum()
    loss_mask: torch.Tensor  # (N,) bool: the sampled response tokens
    old_log_probs: torch.Tensor | None = None  # (N,) float32 each, aligned with input_ids
    ref_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    values: torch.Tensor | None = None
    # row i: (lengths[i] - 1, width) int16, the engine's own tensor: selecting rows moves
    # references, and the bytes are copied when a share is sent, once a step for Ray's ranks
    # (megarl.runtime.stored_rows: StoredRows). Routing replay: the experts are most of a
    # token's bytes, 768 for Qwen3-30B-A3B
    routed_experts: RaggedRows | StoredRows | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    def __getstate__(self) -> dict:
        """Pickled as numpy arrays: Ray then copies each into its object store once, out of band,
        where a torch tensor is first written into a bytes object by torch's own pickling; and a
        share that views rows of a larger batch carries its rows only, where a tensor view is
        pickled with all of its storage. The routing goes row by row, each row's tensor as it is."""
        state = {f.name: (t.numpy() if isinstance(t := getattr(self, f.name), torch.Tensor) else t) for f in fields(self)}
        if isinstance(self.routed_experts, RaggedRows):
            state["routed_experts"] = [row.numpy() for row in self.routed_experts.rows]
        return state

    def __setstate__(self, state: dict) -> None:
        routed = state.pop("routed_experts", None)
        for name, value in state.items():  # Ray's arrays are read-only views of its object store
            setattr(self, name, value if value is None else torch.from_numpy(
                value if value.flags.writeable else value.copy()))
        # the routing is only read: its rows stay views of Ray's store (no copy of the largest field)
        self.routed_experts = routed if routed is None or isinstance(routed, StoredRows) else read_only_rows(routed)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @classmethod
    def from_sequences(cls, prompts: list[list[int]], responses: list[list[int]], response_masks: list[list[int]],
                       rollout_log_probs: list[list[float]] | None = None,
                       routed_experts: list[torch.Tensor | None] | None = None) -> PackedBatch:
        """Rows prompt + response; `routed_experts[row]`: (prompt + response - 1, width), the
        experts of every token but the last. The same checks as `TrainBatch.from_sequences`."""
        if not (len(prompts) == len(responses) == len(response_masks)):
            raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses, {len(response_masks)} masks")
        for row, (p, r, m) in enumerate(zip(prompts, responses, response_masks)):
            if len(m) != len(r):
                raise ValueError(f"row {row}: response of {len(r)} tokens but a mask of {len(m)}")
            if not p:
                raise ValueError(f"row {row}: empty prompt (the first response token needs a context)")
        lengths = torch.tensor([len(p) + len(r) for p, r in zip(prompts, responses)], dtype=torch.long)

        def flat(prompt_part, response_parts, dtype) -> torch.Tensor:  # typed arrays are read as they are
            pieces = [x for p, r in zip(prompts, response_parts) for x in (prompt_part(p, dtype), np.asarray(r, dtype))]
            return torch.from_numpy(np.concatenate(pieces) if pieces else np.zeros(0, dtype))

        def zeros(p, dtype):
            return np.zeros(len(p), dtype)

        ids = flat(lambda p, dtype: np.asarray(p, dtype), responses, np.int32)
        mask = flat(zeros, response_masks, np.bool_)
        rollout = flat(zeros, rollout_log_probs, np.float32) if rollout_log_probs is not None else None
        routed = routing_rows(routed_experts, lengths.tolist()) if routed_experts is not None else None
        return cls(lengths, ids, mask, rollout_log_probs=rollout, routed_experts=routed)

    @classmethod
    def from_rows(cls, batch: TrainBatch) -> PackedBatch:
        """A worker's right-padded rows packed (the inverse of `padded`)."""
        real = batch.attention_mask.bool()
        per_token = {f: getattr(batch, f)[real].float() for f in PER_TOKEN_FIELDS if getattr(batch, f) is not None}
        return cls(real.sum(1), batch.input_ids[real].to(torch.int32), batch.loss_mask[real].bool(),
                   routed_experts=batch.routed_experts, **per_token)

    def starts(self) -> torch.Tensor:
        """(B,) where each row's tokens begin."""
        return torch.cumsum(self.lengths, 0) - self.lengths

    def select(self, index: torch.Tensor | slice | list[int]) -> PackedBatch:
        """The rows at `index`, in its order (a slice of consecutive rows shares the storage)."""
        starts = self.starts()
        if isinstance(index, slice) and index.step in (None, 1):
            rows = range(len(self))[index]
            if not rows:
                return self._rows_of(rows, [])
            lo, hi = int(starts[rows.start]), int(starts[rows.stop - 1] + self.lengths[rows.stop - 1])
            return self._rows_of(rows, [slice(lo, hi)])
        rows = (torch.arange(len(self))[index] if isinstance(index, slice) else torch.as_tensor(index).flatten()).tolist()
        return self._rows_of(rows, [slice(int(starts[i]), int(starts[i] + self.lengths[i])) for i in rows])

    def _rows_of(self, rows: range | list[int], tokens: list[slice]) -> PackedBatch:
        """The batch of `rows`, whose tokens are the runs `tokens` of the per-token fields."""
        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t[tokens[0]] if len(tokens) == 1 else torch.cat([t[s] for s in tokens]) if tokens else t[:0]

        index = slice(rows.start, rows.stop) if isinstance(rows, range) else torch.tensor(rows, dtype=torch.long)
        routed = None if self.routed_experts is None else self.routed_experts[index]
        return replace(self, lengths=self.lengths[index], routed_experts=routed,
                       **{f: take(getattr(self, f)) for f in ("input_ids", "loss_mask", *PER_TOKEN_FIELDS)})

    def only(self, *keep: str) -> PackedBatch:
        """The batch with the float fields not named in `keep` left out (what a call does not read
        is not sent)."""
        return replace(self, **{f: None for f in PER_TOKEN_FIELDS if f not in keep})

    def with_fields(self, **values: torch.Tensor) -> PackedBatch:
        unknown = set(values) - set(PER_TOKEN_FIELDS)
        if unknown:
            raise KeyError(f"unknown PackedBatch fields {sorted(unknown)}; valid: {PER_TOKEN_FIELDS}")
        return replace(self, **values)

    def _positions(self, width: int) -> torch.Tensor:
        return torch.arange(width)[None, :] < self.lengths[:, None]

    def padded(self, pad_id: int = 0) -> TrainBatch:
        """The rows as a worker takes them: right-padded to the longest (megarl.backends.batch)."""
        width = int(self.lengths.max()) if len(self) else 0
        real = self._positions(width)

        def pad(t: torch.Tensor | None, dtype: torch.dtype, fill=0) -> torch.Tensor | None:
            if t is None:
                return None
            out = torch.full(real.shape, fill, dtype=dtype)
            out[real] = t.to(dtype)
            return out

        return TrainBatch(pad(self.input_ids, torch.long, pad_id), real.long(), pad(self.loss_mask, torch.long),
                          routed_experts=self.routed_experts,
                          **{f: pad(getattr(self, f), torch.float32) for f in PER_TOKEN_FIELDS})

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) aligned with `padded()` (L at least the longest row) -> (N, ...)."""
        if not len(self):  # a data-parallel rank's empty share: no rows, no tokens (lengths.max() would fail)
            return padded.flatten(0, 1)
        return padded[:, : int(self.lengths.max())][self._positions(int(self.lengths.max()))]

    def nbytes(self) -> int:
        tensors = [t for f in fields(self) if isinstance(t := getattr(self, f.name), torch.Tensor)]
        tensors += list(self.routed_experts.rows) if isinstance(self.routed_experts, RaggedRows) else []
        return sum(t.numel() * t.element_size() for t in tensors)


def read_only_rows(arrays: list[np.ndarray]) -> RaggedRows:
    """Rows over the arrays' memory, which may be read-only (views of Ray's object store): for
    a field the workers only read (the routing)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return RaggedRows(tuple(torch.from_numpy(a) for a in arrays))


@dataclass(frozen=True)
class StoredRows:
    """A field's rows kept elsewhere (Ray's object store), in place of a `RaggedRows`: `parts`,
    handles whose values are lists of row arrays, the rows in order. Made and read by the
    runtime that stores them (megarl.runtime.stored_rows)."""

    parts: tuple


@dataclass
class DataShare:
    """The rows data-parallel rank `dp_rank` of `dp_size` works on. For an update, `minis` holds,
    mini-batch after mini-batch, how many of `batch`'s rows belong to it and the whole
    mini-batch's loss tokens and rows (every rank normalises its loss by the whole mini-batch);
    for a forward pass (log-probs, values) `minis` is empty and the results are the share's rows."""

    batch: PackedBatch
    dp_rank: int
    dp_size: int
    minis: tuple[tuple[int, int, int], ...] = ()  # (rows here, loss tokens of the mini-batch, its rows)
    rows: tuple[slice, ...] = ()  # the whole batch's rows it holds, runs in order

    def mini_batches(self):
        """(rows of this rank as a PackedBatch, {"num_tokens", "num_seqs"} of the whole mini-batch)."""
        start = 0
        for rows, tokens, seqs in self.minis:
            yield self.batch.select(slice(start, start + rows)), {"num_tokens": tokens, "num_seqs": seqs}
            start += rows


def update_shares(batch: PackedBatch, dp_size: int, mini_rows: int) -> list[DataShare]:
    """Each DP rank's share of an update: a contiguous 1/dp_size of every mini-batch of
    `mini_rows` rows (the last may be shorter; rows past a multiple of dp_size in it are left
    out, as the Megatron backend always did)."""
    return list(iter_update_shares(batch, dp_size, mini_rows))


def iter_update_shares(batch: PackedBatch, dp_size: int, mini_rows: int) -> Iterator[DataShare]:
    """`update_shares` one at a time: each is built when asked for (a caller that sends each on
    holds one share at a time, not a second copy of the batch)."""
    mask_per_row = (np.add.reduceat(batch.loss_mask.numpy(), batch.starts().numpy(), dtype=np.int64)
                    if len(batch) else np.zeros(0, dtype=np.int64))
    runs = update_runs(len(batch), dp_size, mini_rows)
    minis = tuple((run.stop - run.start, int(mask_per_row[start: start + rows].sum()), rows)
                  for run, (start, rows) in zip(runs[0], _minis(len(batch), mini_rows)))
    for r in range(dp_size):
        yield DataShare(_concat_rows(batch, runs[r]), r, dp_size, minis, tuple(runs[r]))


def _minis(rows: int, mini_rows: int) -> list[tuple[int, int]]:
    """(first row, rows) of each mini-batch."""
    return [(start, min(mini_rows, rows - start)) for start in range(0, rows, mini_rows)]


def update_runs(rows: int, dp_size: int, mini_rows: int) -> list[list[slice]]:
    """Each DP rank's rows of an update of `rows` rows: a run of every mini-batch."""
    return [[slice(start + r * (size // dp_size), start + (r + 1) * (size // dp_size))
             for start, size in _minis(rows, mini_rows)] for r in range(dp_size)]


def forward_runs(rows: int, dp_size: int) -> list[slice]:
    """Each DP rank's consecutive rows of a forward pass over `rows` rows."""
    bounds = [rows * r // dp_size for r in range(dp_size + 1)]
    return [slice(bounds[r], bounds[r + 1]) for r in range(dp_size)]


def forward_shares(batch: PackedBatch, dp_size: int) -> list[DataShare]:
    """Each DP rank's consecutive rows for a forward pass; their results, concatenated in rank
    order, are the batch's."""
    return list(iter_forward_shares(batch, dp_size))


def iter_forward_shares(batch: PackedBatch, dp_size: int) -> Iterator[DataShare]:
    """`forward_shares` one at a time."""
    for r, rows in enumerate(forward_runs(len(batch), dp_size)):
        yield DataShare(batch.select(rows), r, dp_size, rows=(rows,))


def _concat_rows(batch: PackedBatch, parts: list[slice]) -> PackedBatch:
    """The rows of `parts` (runs of consecutive rows), one slice of each field per run."""
    parts = [s for s in parts if s.stop > s.start]
    starts = batch.starts().tolist()
    ends = [start + n for start, n in zip(starts, batch.lengths.tolist())]
    tokens = [slice(starts[s.start], ends[s.stop - 1]) for s in parts]
    return batch._rows_of([i for s in parts for i in range(s.start, s.stop)], tokens)


def as_rows(batch: TrainBatch | PackedBatch | DataShare) -> tuple[TrainBatch, Callable[[torch.Tensor], torch.Tensor]]:
    """What a worker computes on: (the rows padded, a function that turns a (B, L) result back
    into the caller's layout: packed for a packed batch or a share, as is for a TrainBatch)."""
    if isinstance(batch, DataShare):
        batch = batch.batch
    if isinstance(batch, PackedBatch):
        return batch.padded(), batch.pack
    return batch, lambda t: t
