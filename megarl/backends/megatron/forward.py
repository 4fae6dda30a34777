"""Micro-batches and passes through megatron's pipeline schedules.

Rows of a `TrainBatch` are grouped into micro-batches either by a fixed number of rows or,
with a token budget (`max_tokens`), dynamically: rows sorted by length, each micro-batch as
many rows as fit in the budget (rows x padded length). Every micro-batch is cut to its own
longest row, rounded up to a multiple of TP so sequence parallelism can split it, so short
rows are not padded to the longest row of the whole batch (the padded fallback of packing:
right padding and causal attention, so real tokens never see padding). With pipeline
parallelism and micro-batches of different shapes, megatron exchanges each activation's
shape before it (`variable_seq_lengths`).

Per-token results (log-probs, entropy, values) live on the last pipeline stage and are
broadcast to every rank of the pipeline group, so any rank can answer for the worker.
Main entry points: `plan_micro_batches`, `split_batch`, `run_schedule`, `forward_per_token`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.backends.batch import TrainBatch


def plan_micro_batches(lengths: list[int], *, micro_batch_size: int, max_tokens: int | None = None,
                       multiple: int = 1) -> list[list[int]]:
    """Row indices of each micro-batch. Without `max_tokens`: consecutive groups of
    `micro_batch_size` rows. With it: rows sorted by length (longest first), each group grown
    while rows x (its longest row rounded up to `multiple`) stays within `max_tokens`; a row
    longer than the budget travels alone."""
    if not max_tokens:
        return [list(range(i, min(i + micro_batch_size, len(lengths)))) for i in range(0, len(lengths), micro_batch_size)]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            group = groups[-1]
            width = -(-max(lengths[group[0]], 1) // multiple) * multiple  # sorted: the first row is the longest
            if (len(group) + 1) * width <= max_tokens:
                group.append(i)
                continue
        groups.append([i])
    return groups


@dataclass
class MicroBatch:
    rows: list[int]  # rows of the source batch, in this micro-batch's order
    data: TrainBatch  # those rows, columns cut to `width`
    input_ids: torch.Tensor  # (rows, padded): width rounded up to the TP multiple
    position_ids: torch.Tensor

    @property
    def width(self) -> int:
        return self.data.input_ids.shape[1]


def make_micro_batches(batch: TrainBatch, plan: list[list[int]], multiple: int) -> list[MicroBatch]:
    lengths = batch.attention_mask.sum(1)
    out = []
    for rows in plan:
        index = torch.tensor(rows, dtype=torch.long)
        width = max(int(lengths[index].max()), 1)
        data = batch.select(index)
        data = data.cut(width)
        padded = -(-width // multiple) * multiple
        ids = torch.nn.functional.pad(data.input_ids, (0, padded - width))
        out.append(MicroBatch(rows, data, ids, torch.arange(padded).expand_as(ids)))
    return out


def split_batch(batch: TrainBatch, *, micro_batch_size: int, max_tokens: int | None = None) -> list[MicroBatch]:
    """`batch` as micro-batches for this rank's layout (widths a multiple of TP)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    plan = plan_micro_batches(batch.attention_mask.sum(1).tolist(), micro_batch_size=micro_batch_size,
                              max_tokens=max_tokens, multiple=tp)
    return make_micro_batches(batch, plan, tp)


# head(output of the last stage, micro-batch) -> (loss, dict of results); called on the last stage only
Head = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict]]


def run_schedule(chunks: list[torch.nn.Module], micros: list[MicroBatch], head: Head, *,
                 forward_only: bool) -> list[dict]:
    """One pass of megatron's forward-backward schedule (1F1B, interleaved with virtual
    stages, or no pipelining) over `micros`; returns the heads' dicts (last stage only).
    With forward_only=False the heads' losses are back-propagated (megatron divides each by
    the number of micro-batches)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(chunks[0].parameters()).device

    def step(data_iterator, model):
        micro = next(data_iterator)
        output = model(micro.input_ids.to(device), micro.position_ids.to(device), attention_mask=None)
        return output, lambda output_tensor: head(output_tensor, micro)

    shapes = {tuple(m.input_ids.shape) for m in micros}
    config = chunks[0].config
    config.variable_seq_lengths = len(shapes) > 1 and parallel_state.get_pipeline_model_parallel_world_size() > 1
    iterators = [iter(micros) for _ in chunks] if len(chunks) > 1 else iter(micros)
    return get_forward_backward_func()(
        forward_step_func=step, data_iterator=iterators, model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micros), seq_length=max(s[1] for s in shapes), micro_batch_size=max(s[0] for s in shapes),
        forward_only=forward_only)


def forward_per_token(chunks: list[torch.nn.Module], batch: TrainBatch, per_token: Callable, names: tuple[str, ...], *,
                      micro_batch_size: int, max_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """{name: (B, L) tensor} on every rank of the pipeline group, without gradients.
    per_token(output_tensor, micro) -> {name: (rows, width) tensor}, entry t for token t;
    entries outside the real tokens and at t = 0 (no context) are zeroed."""
    from megatron.core import parallel_state

    micros = split_batch(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
    device = next(chunks[0].parameters()).device

    def collect(output_tensor, micro):
        return output_tensor.new_zeros(()), {k: v.detach() for k, v in per_token(output_tensor, micro).items()}

    with torch.no_grad():
        store = run_schedule(chunks, micros, collect, forward_only=True)
    out = {name: torch.zeros(batch.input_ids.shape, device=device) for name in names}
    if parallel_state.is_pipeline_last_stage():
        for micro, item in zip(micros, store):
            rows = torch.tensor(micro.rows, device=device)
            for name in names:
                out[name][rows, : micro.width] = item[name].float()
    real = batch.attention_mask.to(device).clone()
    real[:, 0] = 0
    for name in names:
        from_last_stage(out[name])
        out[name] *= real
    return out


def shift_right(per_position: torch.Tensor, width: int) -> torch.Tensor:
    """(rows, S - 1) quantities of token t + 1 given tokens <= t → (rows, width) indexed by
    token, entry 0 zero."""
    zero = per_position.new_zeros((per_position.shape[0], 1))
    return torch.cat([zero, per_position], 1)[:, :width]


def from_last_stage(tensor: torch.Tensor) -> None:
    """Broadcast `tensor` in place from the last pipeline stage to the whole pipeline group."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    torch.distributed.broadcast(tensor, src=last, group=parallel_state.get_pipeline_model_parallel_group())
