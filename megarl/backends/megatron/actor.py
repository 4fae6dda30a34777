"""The megatron backend's actor update: one optimizer step over a mini-batch through
megatron's forward-backward schedules (pipeline aware), DDP with the distributed optimizer.

Every micro-batch's loss is `megarl.backends.loss.actor_loss`, already normalised by the
counts of the whole mini-batch across all data-parallel ranks. megatron divides each
micro-batch's loss by the number of micro-batches and DDP averages gradients over DP, so
the loss handed to megatron is scaled by (micro-batches x DP) to leave the plain sum: the
gradient is the same as the torch backend's, however the mini-batch is split.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from megarl.backends.batch import TrainBatch
from megarl.backends.loss import actor_loss
from megarl.backends.megatron.forward import micro_batches
from megarl.backends.megatron.logprobs import vocab_parallel_log_probs
from megarl.config import AlgorithmConfig, OptimConfig


def wrap_for_training(chunks: list[torch.nn.Module], optim: OptimConfig):
    """(DDP-wrapped chunks, megatron optimizer): distributed optimizer, fp32 gradient
    reduction, global-norm clipping at optim.grad_clip (0 = off)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, \
        finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    wrapped = [DistributedDataParallel(c.config, ddp_config, c) for c in chunks]
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads  # DP reduction, tied-embedding sync
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=optim.grad_clip,
        use_distributed_optimizer=True, params_dtype=config.params_dtype, bf16=config.bf16, fp16=config.fp16),
        wrapped)
    return wrapped, optimizer


def optimizer_step(model: list[torch.nn.Module], optimizer, vocab_size: int, mini: TrainBatch, *,
                   micro_batch_size: int, algo: AlgorithmConfig, counts: dict, lr: float,
                   weight_decay: float, temperature: float = 1.0) -> dict[str, float]:
    """Forward/backward over `mini` (this DP rank's rows) and one optimizer step at `lr`
    and `weight_decay`.
    `counts` (num_tokens, num_seqs, norm_length) are those of the whole mini-batch over all
    DP ranks. Returns metrics averaged by loss-token share over the whole mini-batch (on the
    last pipeline stage; other stages get lr and grad_norm only)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tp = parallel_state.get_tensor_model_parallel_world_size()
    dp = parallel_state.get_data_parallel_world_size()
    ids_list, length = micro_batches(mini, micro_batch_size, tp)
    items = [(ids, mini.select(slice(i * micro_batch_size, (i + 1) * micro_batch_size)))
             for i, ids in enumerate(ids_list)]
    scale = len(items) * dp
    width = mini.input_ids.shape[1]
    device = next(model[0].parameters()).device

    def step(data_iterator, chunk):
        ids, micro = next(data_iterator)
        input_ids = ids["input_ids"].to(device)
        output = chunk(input_ids, ids["position_ids"].to(device), attention_mask=None)

        def loss_of(output_tensor):
            lp, ent = vocab_parallel_log_probs(output_tensor[:, :-1], input_ids[:, 1:], vocab_size,
                                               temperature=temperature, with_entropy=True)
            zero = lp.new_zeros((lp.shape[0], 1))
            lp, ent = torch.cat([zero, lp], 1)[:, :width], torch.cat([zero, ent], 1)[:, :width]
            loss, metrics = actor_loss(lp, ent, micro, algo, counts)
            metrics["share"] = float(micro.loss_mask.sum()) / max(counts["num_tokens"], 1)
            return loss * scale, metrics

        return output, loss_of

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    for group in optimizer.param_groups:  # what megatron's OptimizerParamScheduler would set
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)  # 0 on biases and norms
    iterators = [iter(items) for _ in model] if len(model) > 1 else iter(items)
    store = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iterators, model=model if len(model) > 1 else model[0],
        num_microbatches=len(items), seq_length=length, micro_batch_size=micro_batch_size, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    metrics: dict[str, float] = defaultdict(float)
    for item in store:
        share = item.pop("share")
        for key, value in item.items():
            metrics[key] += share * value
    if dp > 1 and metrics:  # each DP rank weighted its rows by their share of the global tokens
        keys = sorted(metrics)
        summed = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
        torch.distributed.all_reduce(summed, group=parallel_state.get_data_parallel_group())
        metrics = defaultdict(float, zip(keys, summed.tolist()))
    metrics["lr"] = lr
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    if not ok:
        metrics["skipped_steps"] = 1.0
    return dict(metrics)
