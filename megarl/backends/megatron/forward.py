"""Forward passes through megatron's pipeline schedules: per-token log-probs and entropy.

Micro-batches are padded rows of a `TrainBatch` (right padding, causal attention, so real
tokens never see padding); the sequence length is padded to a multiple of TP so sequence
parallelism can split it. The results live on the last pipeline stage and are broadcast to
every rank of the pipeline group, so any rank can answer for the worker.
"""

from __future__ import annotations

import torch

from megarl.backends.batch import TrainBatch
from megarl.backends.megatron.logprobs import vocab_parallel_log_probs


def micro_batches(batch: TrainBatch, size: int, multiple: int) -> tuple[list[dict], int]:
    """Dicts of input_ids / position_ids for micro-batches of `size` rows, every one padded
    to the same length (a multiple of `multiple`), as the pipeline schedule needs."""
    length = batch.input_ids.shape[1]
    length = -(-length // multiple) * multiple
    out = []
    for start in range(0, len(batch), size):
        ids = batch.input_ids[start:start + size]
        ids = torch.nn.functional.pad(ids, (0, length - ids.shape[1]))
        out.append({"input_ids": ids, "position_ids": torch.arange(length).expand_as(ids)})
    return out, length


def forward_log_probs(chunks: list[torch.nn.Module], vocab_size: int, batch: TrainBatch, *, micro_batch_size: int,
                      temperature: float = 1.0, with_entropy: bool = False):
    """(log_probs, entropy or None), each (B, L) as the torch backend's `token_log_probs`:
    entry t is for token t given tokens < t, entry 0 is 0."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tp = parallel_state.get_tensor_model_parallel_world_size()
    micros, length = micro_batches(batch, micro_batch_size, tp)
    device = next(chunks[0].parameters()).device

    def step(data_iterator, model):
        micro = next(data_iterator)
        ids = micro["input_ids"].to(device)
        output = model(ids, micro["position_ids"].to(device), attention_mask=None)

        def collect(output_tensor):
            lp, ent = vocab_parallel_log_probs(output_tensor[:, :-1], ids[:, 1:], vocab_size,
                                               temperature=temperature, with_entropy=with_entropy)
            return output_tensor.new_zeros(()), {"log_probs": lp.detach(), "entropy": ent}

        return output, collect

    iterators = [iter(micros) for _ in chunks] if len(chunks) > 1 else iter(micros)
    with torch.no_grad():
        store = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iterators, model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micros), seq_length=length, micro_batch_size=micro_batch_size, forward_only=True)
    width = batch.input_ids.shape[1]
    shape = (len(batch), width)
    log_probs = torch.zeros(shape, device=device)
    entropy = torch.zeros(shape, device=device) if with_entropy else None
    if parallel_state.is_pipeline_last_stage():
        rows = 0
        for item in store:
            n = item["log_probs"].shape[0]
            log_probs[rows:rows + n, 1:] = item["log_probs"][:, : width - 1]
            if with_entropy:
                entropy[rows:rows + n, 1:] = item["entropy"].detach()[:, : width - 1]
            rows += n
    _from_last_stage(log_probs)
    if with_entropy:
        _from_last_stage(entropy)
    real = batch.attention_mask.to(device).clone()
    real[:, 0] = 0  # the first token has no context
    return log_probs * real, (entropy * real if with_entropy else None)


def _from_last_stage(tensor: torch.Tensor) -> None:
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    torch.distributed.broadcast(tensor, src=last, group=parallel_state.get_pipeline_model_parallel_group())
