"""Bodies of the multi-process megatron tests (run by tests/megatron_dist.py on each rank)."""

from __future__ import annotations

import torch


def logprobs_and_export(hf_dir: str, layout_kw: dict, batch, micro_batch_size: int, dtype: str = "float32"):
    """On this rank: build the layout, load the HF checkpoint, compute log-probs and entropy
    of `batch`, and export the HF tensors. Returns (log_probs, entropy, {name: tensor} of
    this stage when TP rank 0 else {})."""
    from megatron.core import parallel_state

    from megarl.backends.megatron.actor import forward_log_probs
    from megarl.backends.megatron.model import Layout, build_model, export_hf_tensors, initialize, load_hf_weights
    from megarl.models import ModelSpec

    spec = ModelSpec.from_hf(hf_dir)
    layout = Layout(**layout_kw)
    layout.check(spec, torch.distributed.get_world_size())
    initialize(layout, seed=0)
    chunks = build_model(spec, layout, dtype=dtype)
    load_hf_weights(chunks, spec, hf_dir)
    log_probs, entropy = forward_log_probs(chunks, spec.vocab_size, batch, micro_batch_size=micro_batch_size,
                                           with_entropy=True)
    exported = dict(export_hf_tensors(chunks, spec))
    keep = parallel_state.get_tensor_model_parallel_rank() == 0
    return log_probs, entropy, (exported if keep else {})


def actor_step(hf_dir: str, layout_kw: dict, batch, micro_batch_size: int, algo, optim):
    """One megatron optimizer step on `batch` (each DP rank takes its contiguous share of the
    rows); returns this stage's updated HF tensors (on TP rank 0 of DP rank 0) and the metrics."""
    from megatron.core import parallel_state

    from megarl.backends.megatron.actor import actor_step
    from megarl.backends.megatron.step import wrap_for_training
    from megarl.backends.megatron.model import Layout, build_model, export_hf_tensors, initialize, load_hf_weights
    from megarl.models import ModelSpec

    spec = ModelSpec.from_hf(hf_dir)
    layout = Layout(**layout_kw)
    initialize(layout, seed=0)
    chunks = build_model(spec, layout)
    load_hf_weights(chunks, spec, hf_dir)
    model, optimizer = wrap_for_training(chunks, optim)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    rows = len(batch) // dp
    counts = {"num_tokens": int(batch.loss_mask.sum()), "num_seqs": len(batch), "norm_length": None}
    metrics = actor_step(model, optimizer, spec.vocab_size, batch.select(slice(dp_rank * rows, (dp_rank + 1) * rows)),
                             micro_batch_size=micro_batch_size, algo=algo, counts=counts, lr=optim.lr,
                             weight_decay=optim.weight_decay)
    exported = dict(export_hf_tensors(chunks, spec))
    keep = parallel_state.get_tensor_model_parallel_rank() == 0 and dp_rank == 0
    return (exported if keep else {}), metrics
