"""One optimizer step of a megatron model (actor or critic) over a mini-batch: DDP with the
distributed optimizer, megatron's forward-backward schedules, global-norm clipping.

Every micro-batch's loss is already normalised by the counts of the whole mini-batch across
all data-parallel ranks (megarl.algo.aggregation). megatron divides each micro-batch's loss
by the number of micro-batches and DDP averages gradients over DP, so the head's loss is
scaled by (micro-batches x DP) to leave the plain sum (under context parallelism each CP
rank's loss covers its own tokens, and megatron's CP factor and averaging cancel): the gradient is the torch backend's,
however the mini-batch is split. Main entry points: `wrap_for_training`, `optimizer_step`.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

from megarl.backends.megatron.collectives import reduce_values
from megarl.backends.megatron.forward import Head, MicroBatch, run_schedule
from megarl.config import OptimConfig

log = logging.getLogger(__name__)


def wrap_for_training(chunks: list[torch.nn.Module], optim: OptimConfig, *, distributed_optimizer: bool = True,
                      fp8_param_gather: bool = False, fp8_recipe: str | None = None):
    """(DDP-wrapped chunks, megatron Adam optimizer) as `optimizer_config` describes it.

    The optimizer's FP32 master weights are built here from the chunks' current weights
    (of FP8 parameters: from the high-precision copy model.keep_master_source wrote, freed once
    the masters exist), so load the weights first."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, \
        finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    from megarl.backends.megatron.model import free_master_sources

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                               grad_reduce_in_fp32=True, fp8_param_gather=fp8_param_gather)
    wrapped = [DistributedDataParallel(c.config, ddp_config, c) for c in chunks]
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads  # DP reduction, tied-embedding sync
    optimizer = get_megatron_optimizer(optimizer_config(optim, config, distributed_optimizer=distributed_optimizer,
                                                        fp8_recipe=fp8_recipe, cuda=torch.cuda.is_available()),
                                       wrapped)
    free_master_sources(chunks)
    return wrapped, optimizer


def optimizer_config(optim: OptimConfig, model_config, *, distributed_optimizer: bool, fp8_recipe: str | None,
                     cuda: bool):
    """megatron's OptimizerConfig: Adam with global-norm clipping at optim.grad_clip (0 = off),
    state sharded over DP when `distributed_optimizer`, the precision of `model_config` (a
    TransformerConfig), and `fp8_recipe` (the model's FP8 recipe, None without FP8), which the
    distributed optimizer needs to handle FP8 parameters (blockwise ones cannot be viewed flat
    as delayed-scaling ones can).

    optim.offload on a GPU: megatron's HybridDeviceOptimizer with all of Adam's state, the FP32
    master weights and the step on the host. Megatron-LM refuses --optimizer-cpu-offload
    without --use-precision-aware-optimizer, "as the hybrid device optimizer reuses the code
    path of this flag": only in that mode does the distributed optimizer hand the hybrid one
    the model's own parameter shards (without it, FP32 masters are made on the GPU as well, and
    copied to the host once more). The precision-aware optimizer in turn needs the distributed
    optimizer (config validation asks for it with offload). Without CUDA the hybrid optimizer
    cannot run (it uses CUDA streams) and has nothing to do: the state is in host memory already."""
    from megatron.core.optimizer import OptimizerConfig

    offload = {}
    if optim.offload and cuda:
        offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True)
    elif optim.offload:
        log.info("optimizer offload has nothing to do without a GPU: the optimizer state is in host memory already")
    return OptimizerConfig(
        optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=optim.grad_clip,
        use_distributed_optimizer=distributed_optimizer, params_dtype=model_config.params_dtype,
        bf16=model_config.bf16, fp16=model_config.fp16, fp8_recipe=fp8_recipe, **offload)


def loss_scale(num_micro_batches: int) -> int:
    """What a micro-batch's loss is multiplied by so megatron's averaging leaves the sum.
    (Gradients are averaged over the data- and context-parallel ranks together, and the
    schedule itself multiplies every loss by the CP size, so CP needs nothing here.)"""
    from megatron.core import parallel_state

    return num_micro_batches * parallel_state.get_data_parallel_world_size()


def optimizer_step(model: list[torch.nn.Module], optimizer, micros: list[MicroBatch], head: Head, *, lr: float,
                   weight_decay: float, num_tokens: int) -> dict[str, float]:
    """Forward/backward over `micros` (this DP rank's rows) and one step at `lr` and
    `weight_decay`. `head` returns (scaled loss, metrics); metrics are averaged by each
    micro-batch's share of the mini-batch's `num_tokens` loss tokens over all DP (and CP) ranks, and
    every rank returns the same dict (lr, grad_norm, and skipped_steps = 1 when the
    gradient norm was NaN/inf and the weights stayed as they were)."""
    from megatron.core import parallel_state

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    for group in optimizer.param_groups:  # what megatron's OptimizerParamScheduler would set
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)  # 0 on biases and norms
    store = run_schedule(model, micros, head, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    metrics: dict[str, float] = defaultdict(float)
    for micro, item in zip(micros, store):
        share = float(micro.data.loss_mask.sum()) / max(num_tokens, 1)
        for key, value in item.items():
            metrics[key] += share * value
    metrics = _sum_over_data_parallel(dict(metrics))
    metrics = _from_last_stage(metrics)
    metrics["lr"] = lr
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    if not ok:
        metrics["skipped_steps"] = 1.0
    return metrics


def _sum_over_data_parallel(metrics: dict[str, float]) -> dict[str, float]:
    """Each DP (and CP) rank weighted its rows (its tokens) by their share of the global
    tokens: the sum is the mean."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size(with_context_parallel=True) == 1 or not metrics:
        return metrics
    keys = sorted(metrics)
    summed = reduce_values([metrics[k] for k in keys], parallel_state.get_data_parallel_group(with_context_parallel=True))
    return dict(zip(keys, summed))


def _from_last_stage(metrics: dict[str, float]) -> dict[str, float]:
    """The last pipeline stage computed the losses: every stage returns its metrics."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return metrics
    box = [metrics]
    torch.distributed.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                            group=parallel_state.get_pipeline_model_parallel_group())
    return box[0]
