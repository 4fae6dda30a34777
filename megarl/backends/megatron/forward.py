"""Micro-batches and passes through megatron's pipeline schedules.

Rows of a `TrainBatch` are grouped into micro-batches either by a fixed number of rows or,
with a token budget (`max_tokens`), dynamically: rows sorted by length, each micro-batch as
many rows as fit in the budget. A micro-batch reaches the model in one of two forms:

- padded (the fallback): rows x width, cut to the micro-batch's own longest row (rounded up
  to `token_multiple`: TP, so sequence parallelism can split it; more under context
  parallelism and FP8), right padding and causal
  attention, so real tokens never see padding; the budget counts rows x width.
- packed (`packing`): the rows' real tokens end to end in one row of `total` tokens (rounded
  up to the same multiple with a padding segment), sequence boundaries in `cu_seqlens`, so no
  compute is spent on padding and the budget counts real tokens. "thd" hands the boundaries
  to Transformer Engine's attention (megatron's THD format: positions restart per sequence);
  "mask" is for megatron's local layers, which have no THD path: one block-diagonal causal
  mask keeps each sequence to itself (a total x total mask, for CPU and small runs; rotary
  position embeddings depend only on the distance between two tokens of one sequence, so
  the continuing positions give the padded form's results).

Per-position outputs (the quantity of the next token given the tokens so far) go back to
the batch's (rows, width) token layout with `MicroBatch.by_token`, the same for both forms.
Per-token results (log-probs, entropy, values) live on the last pipeline stage and are
broadcast to every rank of the pipeline group, so any rank can answer for the worker.
Main entry points: `plan_micro_batches`, `split_batch`, `run_schedule`, `forward_per_token`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from megarl.backends.batch import TrainBatch

PACKING = (None, "thd", "mask")


def packing_for(pack_sequences: bool | None, impl: str) -> str | None:
    """The packing of a worker (`pack_sequences` None: wherever the attention has a packed
    path of its own, i.e. Transformer Engine's THD; True: also on megatron's local layers,
    through a mask; False: never)."""
    if pack_sequences is False:
        return None
    if impl == "transformer_engine":
        return "thd"
    return "mask" if pack_sequences else None


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# tokens per rank an FP8 GEMM needs a multiple of, by Transformer Engine recipe (megarl's
# `actor.fp8_recipe` values); see `token_multiple`
FP8_TOKEN_ALIGNMENT = {"delayed": 16, "tensorwise": 16, "blockwise": 128}


def token_multiple(tp: int, cp: int = 1, *, sequence_parallel: bool = False, fp8_recipe: str | None = None) -> int:
    """What the length of a padded row, or of a packed row, is rounded up to.

    Without FP8: TP (sequence parallelism splits the sequence over the TP ranks), and with
    context parallelism 2 x CP x TP (megatron's load-balanced layout cuts each row into 2 x CP
    chunks, two per CP rank). With FP8 (`fp8_recipe` not None) every rank's share of a row,
    length / CP (and / TP more under sequence parallelism, where each TP rank quantises its
    own slice before the all-gather), must also be a multiple of the recipe's alignment a
    (FP8_TOKEN_ALIGNMENT):

        multiple = lcm(TP x (2 x CP if CP > 1 else 1),  a x CP x (TP if sequence_parallel else 1))

    a = 16 for the per-tensor recipes (delayed, tensorwise): Transformer Engine refuses an FP8
    GEMM operand whose last dimension is not a multiple of 16 (the others' product: of 8), and
    the weight-gradient GEMM has the tokens last; megatron-core aligns to 16 too
    (fp8_utils.get_fp8_align_size). a = 128 for blockwise: it quantises activations in 1 x 128
    tiles and weights in 128 x 128 blocks; megatron-core asks only 16 of it, verl pads each
    rank's share to 128, and so does megarl (the cost: under `multiple` padding tokens a row).
    MXFP8 (not offered) would need 32.
    Worked: TP 2 -> 2; TP 2, FP8 -> 16; TP 4 with SP, FP8 -> 64; TP 2, CP 2, FP8 -> 32;
    TP 2, CP 2 with SP, blockwise -> 512.
    """
    multiple = tp * (2 * cp if cp > 1 else 1)
    if fp8_recipe is None:
        return multiple
    recipe = getattr(fp8_recipe, "value", fp8_recipe)  # megatron's Fp8Recipe enum or its name
    if recipe not in FP8_TOKEN_ALIGNMENT:
        raise ValueError(f"fp8_recipe {recipe!r}: use one of {sorted(FP8_TOKEN_ALIGNMENT)}")
    share = FP8_TOKEN_ALIGNMENT[recipe] * cp * (tp if sequence_parallel else 1)
    return math.lcm(multiple, share)


def plan_micro_batches(lengths: list[int], *, micro_batch_size: int, max_tokens: int | None = None,
                       multiple: int = 1, packed: bool = False, count: int = 0) -> list[list[int]]:
    """Row indices of each micro-batch. Without `max_tokens`: consecutive groups of
    `micro_batch_size` rows. With it: rows sorted by length (longest first), each placed in
    the first micro-batch it fits (padded: rows x its longest row rounded up to `multiple`;
    packed: the sum of the rows' lengths rounded up to `multiple`) within `max_tokens`; a
    row longer than the budget travels alone. `count`: at least that many micro-batches where
    the rows allow (`split_to_count`)."""
    if not max_tokens:
        groups = [list(range(i, min(i + micro_batch_size, len(lengths))))
                  for i in range(0, len(lengths), micro_batch_size)]
        return split_to_count(groups, lengths, count, multiple=multiple, packed=packed)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    used: list[int] = []  # packed: the real tokens of each group
    for i in order:
        n = max(lengths[i], 1)
        for g, group in enumerate(groups):
            if packed:
                fits = round_up(used[g] + n, multiple) <= max_tokens
            else:  # sorted: the group's first row is its longest
                fits = (len(group) + 1) * round_up(max(lengths[group[0]], 1), multiple) <= max_tokens
            if fits:
                group.append(i)
                used[g] += n
                break
        else:
            groups.append([i])
            used.append(n)
    return split_to_count(groups, lengths, count, multiple=multiple, packed=packed)


def split_to_count(groups: list[list[int]], lengths: list[int], count: int, *, multiple: int = 1,
                   packed: bool = False) -> list[list[int]]:
    """`groups` with the costliest group of two or more rows cut in two (its first half of rows,
    then the rest, in place) until there are `count` groups or every group is one row. The cost
    is a micro-batch's tokens through the model: padded, rows x its longest row; packed, the
    sum of its rows (each rounded up to `multiple`). This is how the data-parallel ranks that
    share a collective per micro-batch (an MoE layer's expert all-to-all) come to run as many
    micro-batches each, without a micro-batch that carries no row."""
    def cost(group: list[int]) -> int:
        if packed:
            return round_up(sum(max(lengths[i], 1) for i in group), multiple)
        return len(group) * round_up(max(max(lengths[i], 1) for i in group), multiple)

    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [g for g, group in enumerate(groups) if len(group) > 1]
        if not splittable:
            break
        g = max(splittable, key=lambda g: cost(groups[g]))  # the first of equal costs
        half = (len(groups[g]) + 1) // 2
        groups[g: g + 1] = [groups[g][:half], groups[g][half:]]
    return groups


@dataclass
class MicroBatch:
    rows: list[int]  # rows of the source batch, in this micro-batch's order
    data: TrainBatch  # those rows, columns cut to `width`
    input_ids: torch.Tensor  # what the model reads: (rows, padded width), or packed (1, total)
    position_ids: torch.Tensor  # as input_ids; packed: restarting at every sequence
    targets: torch.Tensor  # as input_ids: the token after each position (0 where there is none)
    packing: str | None = None
    cu_seqlens: torch.Tensor | None = None  # packed: (sequences + 1,) int32 starts in input_ids, then the end
    owned: torch.Tensor | None = None  # context parallel: the positions of the padded rows this rank holds
    cp: int = 1
    real: torch.Tensor | None = None  # bool as input_ids: a token of a sequence (not padding)
    routed: torch.Tensor | None = None  # routing replay: as input_ids, plus the experts' width (-1: none)
    stand_in: bool = False  # a forward's placeholder run only to meet the other ranks' collectives (`stand_in`)

    @property
    def width(self) -> int:
        return self.data.input_ids.shape[1]

    @property
    def seq_length(self) -> int:
        """Positions of a whole (padded or packed) sequence, over all CP ranks."""
        return self.input_ids.shape[1] * self.cp

    def by_token(self, per_position: torch.Tensor) -> torch.Tensor:
        """(rows, width) entry t = the model's output at the position of token t - 1 (the
        quantity of token t given tokens < t) from `per_position` shaped as input_ids (plus
        trailing dimensions); entry 0, and entries past a row's end, are 0. Differentiable."""
        if self.owned is not None:  # this rank's positions into the whole rows (zeros elsewhere)
            whole = per_position.new_zeros((per_position.shape[0], self.seq_length, *per_position.shape[2:]))
            per_position = whole.index_copy(1, self.owned.to(per_position.device), per_position)
        if self.cu_seqlens is None:
            zero = per_position.new_zeros((per_position.shape[0], 1, *per_position.shape[2:]))
            return torch.cat([zero, per_position[:, :-1]], 1)[:, : self.width]
        starts = self.cu_seqlens[: len(self.rows)].to(per_position.device, torch.long)
        t = torch.arange(self.width, device=per_position.device)
        lengths = self.data.attention_mask.sum(1).to(per_position.device)
        keep = (t > 0) & (t < lengths[:, None])
        index = (starts[:, None] + t - 1).clamp(0, per_position.shape[1] - 1)
        picked = per_position[0][index]
        keep = keep.reshape(*keep.shape, *([1] * (picked.dim() - 2)))
        return torch.where(keep, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))

    def model_inputs(self, device, model=None) -> dict:
        """GPTModel.forward's keyword arguments for this micro-batch. A mixture of experts also
        gets the padding (megatron's `padding_mask`, True at padding), so padding positions
        count neither in the load-balancing loss nor in the experts' token counts; a later
        pipeline stage under sequence parallelism gets this TP rank's share of it, as megatron
        cuts it on the first stage."""
        kw = {"input_ids": self.input_ids.to(device), "position_ids": self.position_ids.to(device),
              "attention_mask": None}
        if model is not None and getattr(model.config, "num_moe_experts", None) and self.real is not None:
            padding = ~self.real
            if model.config.sequence_parallel and not model.pre_process:
                from megatron.core import parallel_state

                padding = padding.chunk(parallel_state.get_tensor_model_parallel_world_size(), dim=1)[
                    parallel_state.get_tensor_model_parallel_rank()]
            kw["padding_mask"] = padding.to(device)
        if self.packing == "mask":
            kw["attention_mask"] = block_causal_mask(self.cu_seqlens).to(device)
        elif self.packing == "thd":
            from megatron.core.packed_seq_params import PackedSeqParams

            cu = self.cu_seqlens.to(device)
            longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
            kw["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                      max_seqlen_q=longest, max_seqlen_kv=longest)
        return kw


def block_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(1, 1, total, total) bool, True where attention is masked out: a query sees only
    keys of its own sequence at or before it (megatron's local attention mask convention)."""
    total = int(cu_seqlens[-1])
    segment = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), (cu_seqlens[1:] - cu_seqlens[:-1]).long())
    position = torch.arange(total)
    allowed = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
    return (~allowed)[None, None]


def next_tokens(ids: torch.Tensor) -> torch.Tensor:
    """ids shifted left by one along the last dimension, 0 at the end."""
    return torch.nn.functional.pad(ids[..., 1:], (0, 1))


def make_micro_batches(batch: TrainBatch, plan: list[list[int]], multiple: int, packing: str | None = None,
                       cp: int = 1, cp_rank: int = 0) -> list[MicroBatch]:
    """The micro-batches of `plan`, each padded row, or the packed row, padded to a multiple of
    `multiple` (`token_multiple`). With context parallelism (cp > 1; `multiple` then a
    multiple of 2 x cp) every padded row, or the packed row of a "mask" micro-batch (THD
    packing is not split over CP ranks), is split and this CP rank gets its share, with a
    loss mask kept to the tokens whose outputs it holds."""
    if packing not in PACKING:
        raise ValueError(f"packing {packing!r}: use one of {PACKING}")
    if cp > 1 and packing == "thd":
        raise ValueError("THD-packed sequences are not split over context-parallel ranks: use padded rows")
    if cp > 1 and multiple % (2 * cp):
        raise ValueError(f"rows split over cp={cp} ranks need a length multiple of 2 x cp, not {multiple}: "
                         "take it from token_multiple")
    lengths = batch.attention_mask.sum(1)
    out = []
    for rows in plan:
        index = torch.tensor(rows, dtype=torch.long)
        width = max(int(lengths[index].max()), 1)
        data = batch.select(index).cut(width)
        if packing is None:
            ids = torch.nn.functional.pad(data.input_ids, (0, round_up(width, multiple) - width))
            routed = None if data.routed_experts is None else data.routed_experts.padded(ids.shape[1])
            micro = MicroBatch(rows, data, ids, torch.arange(ids.shape[1]).expand_as(ids), next_tokens(ids),
                               real=torch.arange(ids.shape[1])[None] < lengths[index][:, None], routed=routed)
        else:
            row_lengths = [max(int(n), 1) for n in lengths[index]]
            sequences = [data.input_ids[r, :n] for r, n in enumerate(row_lengths)]
            real = sum(row_lengths)
            total = round_up(real, multiple)
            if total > real:  # a padding segment of its own, so the last sequence never sees it
                sequences.append(data.input_ids.new_zeros(total - real))
            bounds = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0).to(torch.int32)
            routed = None
            if data.routed_experts is not None:  # the sequences' rows end to end, then the padding's
                whole = data.routing()
                routed = torch.full((1, total, whole.shape[-1]), -1, dtype=whole.dtype)
                routed[0, :real] = torch.cat([whole[r, :n] for r, n in enumerate(row_lengths)])
            micro = MicroBatch(rows, data, torch.cat(sequences)[None],
                               torch.cat([torch.arange(len(s)) for s in sequences])[None],
                               torch.cat([next_tokens(s) for s in sequences])[None], packing, bounds,
                               real=(torch.arange(total) < real)[None], routed=routed)
        out.append(micro if cp == 1 else _context_share(micro, cp, cp_rank))
    return out


def _context_share(micro: MicroBatch, cp: int, cp_rank: int) -> MicroBatch:
    """This CP rank's positions of `micro` (whose model rows split into 2 x cp chunks), and
    its loss mask kept to the tokens predicted at those positions."""
    from megarl.backends.megatron.context import owned_positions

    owned = owned_positions(micro.input_ids.shape[1], cp, cp_rank)
    mine = torch.zeros(micro.input_ids.shape, dtype=micro.data.loss_mask.dtype)
    mine[:, owned] = 1
    held = micro.by_token(mine)  # 1 where token t's output (at position t - 1) is on this rank
    data = replace(micro.data, loss_mask=micro.data.loss_mask * held)
    return replace(micro, data=data, input_ids=micro.input_ids[:, owned], position_ids=micro.position_ids[:, owned],
                   targets=micro.targets[:, owned], owned=owned, cp=cp, real=micro.real[:, owned],
                   routed=None if micro.routed is None else micro.routed[:, owned])


def split_batch(batch: TrainBatch, config, *, micro_batch_size: int, max_tokens: int | None = None,
                packing: str | None = None, forward_only: bool = False) -> list[MicroBatch]:
    """`batch` as micro-batches for this rank's layout and the model's TransformerConfig
    `config` (its sequence parallelism and FP8 recipe): lengths a multiple of `token_multiple`.

    Every data-parallel rank gets as many micro-batches as the rank with the most: an MoE layer
    runs its expert all-to-all once a micro-batch, and with expert parallelism spanning the
    data-parallel replicas a rank that ran out of micro-batches would leave the others waiting
    in it. A rank with fewer splits its own (`split_to_count`); an update's ranks hold as many
    rows each, so that always suffices there. A forward's rank can hold fewer rows than the
    count (uneven shares; fewer rows than ranks, as the weights probe's 4 sequences at DP 8):
    it runs stand-in micro-batches (`stand_in`), whose results are dropped."""
    from megatron.core import parallel_state

    from megarl.backends.megatron.collectives import most_over_data_parallel

    tp, cp = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_context_parallel_world_size()
    multiple = token_multiple(tp, cp, sequence_parallel=config.sequence_parallel,
                              fp8_recipe=config.fp8_recipe if config.fp8 else None)
    lengths = batch.attention_mask.sum(1).tolist()
    plan = plan_micro_batches(lengths, micro_batch_size=micro_batch_size, max_tokens=max_tokens, multiple=multiple,
                              packed=packing is not None)
    count = most_over_data_parallel(len(plan))
    plan = split_to_count(plan, lengths, count, multiple=multiple, packed=packing is not None)
    cp_rank = parallel_state.get_context_parallel_rank()
    micros = make_micro_batches(batch, plan, multiple, packing, cp, cp_rank)
    if len(micros) < count:
        if not forward_only:
            raise RuntimeError(f"an update of {len(batch)} rows on this data-parallel rank cannot make the {count} "
                               "micro-batches another rank has: the ranks of an update must hold as many rows each")
        micros += [stand_in(multiple, packing, cp, cp_rank) for _ in range(count - len(micros))]
    return micros


def stand_in(multiple: int, packing: str | None = None, cp: int = 1, cp_rank: int = 0) -> MicroBatch:
    """A forward's placeholder micro-batch: one row of `multiple` token-0 positions, no loss
    token, routed by the model itself. It takes part in every collective a micro-batch's
    forward does; its results are never read."""
    batch = TrainBatch.from_sequences([[0]], [[]], [[]])
    micro = make_micro_batches(batch, [[0]], multiple, packing, cp, cp_rank)[0]
    return replace(micro, stand_in=True)


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

    from megarl.backends.megatron.routing import replaying, set_micro_routing

    device = next(chunks[0].parameters()).device

    def step(data_iterator, model):
        micro = next(data_iterator)
        set_micro_routing(model, micro.routed, by_itself=micro.stand_in)  # routing replay, on the actor's routers
        output = model(**micro.model_inputs(device, _unwrapped(model)))
        return output, lambda output_tensor: head(output_tensor, micro)

    shapes = {tuple(m.input_ids.shape) for m in micros}
    config = chunks[0].config
    config.variable_seq_lengths = len(shapes) > 1 and parallel_state.get_pipeline_model_parallel_world_size() > 1
    iterators = [iter(micros) for _ in chunks] if len(chunks) > 1 else iter(micros)
    with replaying(chunks):
        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=iterators, model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micros), seq_length=max(m.seq_length for m in micros),
            micro_batch_size=max(s[0] for s in shapes), forward_only=forward_only)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP (and Float16Module) wrappers."""
    while hasattr(model, "module") and not hasattr(model, "pre_process"):
        model = model.module
    return model


def forward_per_token(chunks: list[torch.nn.Module], batch: TrainBatch, per_token: Callable, names: tuple[str, ...], *,
                      micro_batch_size: int, max_tokens: int | None = None,
                      packing: str | None = None) -> dict[str, torch.Tensor]:
    """{name: (B, L) tensor} on every rank of the pipeline group, without gradients.
    per_token(output_tensor, micro) -> {name: (rows, width) tensor}, entry t for token t
    (see MicroBatch.by_token); entries outside the real tokens and at t = 0 (no context) are zeroed."""
    from megatron.core import parallel_state

    micros = split_batch(batch, chunks[0].config, micro_batch_size=micro_batch_size, max_tokens=max_tokens,
                         packing=packing, forward_only=True)
    device = next(chunks[0].parameters()).device

    def collect(output_tensor, micro):
        return output_tensor.new_zeros(()), {k: v.detach() for k, v in per_token(output_tensor, micro).items()}

    with torch.no_grad():
        store = run_schedule(chunks, micros, collect, forward_only=True)
    out = {name: torch.zeros(batch.input_ids.shape, device=device) for name in names}
    if parallel_state.is_pipeline_last_stage():
        for micro, item in zip(micros, store):
            if micro.stand_in:
                continue
            rows = torch.tensor(micro.rows, device=device)
            for name in names:
                out[name][rows, : micro.width] = item[name].float()
    if parallel_state.get_context_parallel_world_size() > 1:  # each token's result is on one CP rank
        for name in names:
            torch.distributed.all_reduce(out[name], group=parallel_state.get_context_parallel_group())
    real = batch.attention_mask.to(device).clone()
    real[:, :1] = 0  # (a rank's share may be empty: no column 0)
    for name in names:
        from_last_stage(out[name])
        out[name] *= real
    return out


def from_last_stage(tensor: torch.Tensor) -> None:
    """Broadcast `tensor` in place from the last pipeline stage to the whole pipeline group."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    torch.distributed.broadcast(tensor, src=last, group=parallel_state.get_pipeline_model_parallel_group())
