"""Small collectives of the megatron backend: counts and metrics reduced over a process group.

A group's backend decides where its tensors must live: NCCL reduces only CUDA tensors (a CPU
tensor is refused with "No backend type associated with device type cpu"), gloo host tensors.
Megatron's groups take the default backend, NCCL on GPUs, so a reduction of a few numbers built
on the host must move to the GPU first. Main entry points: `reduce_values`, `most_over_data_parallel`.
"""

from __future__ import annotations

import torch


def collective_device(backend: str) -> torch.device:
    """Where a tensor reduced by a group of `backend` must be."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_values(values: list[float], group, *, op=None, dtype=torch.float64) -> list[float]:
    """`values` all-reduced over `group` (a sum, or `op`), as Python numbers on every rank."""
    op = torch.distributed.ReduceOp.SUM if op is None else op
    tensor = torch.tensor(values, dtype=dtype, device=collective_device(torch.distributed.get_backend(group)))
    torch.distributed.all_reduce(tensor, op=op, group=group)
    return tensor.cpu().tolist()


def most_over_data_parallel(count: int) -> int:
    """The largest `count` of the data-parallel (and context-parallel) ranks that share this rank's
    model-parallel position; every rank of the world gets the same answer, since the ranks of one
    data-parallel rank (its TP, PP and CP peers) plan from the same rows."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size(with_context_parallel=True) == 1:
        return count
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return int(reduce_values([count], group, op=torch.distributed.ReduceOp.MAX, dtype=torch.int64)[0])
