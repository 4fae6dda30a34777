"""Bodies of the multi-process megatron tests (run by tests/megatron_dist.py on each rank)."""

from __future__ import annotations

import torch


def logprobs_and_export(hf_dir: str, layout_kw: dict, batch, micro_batch_size: int, dtype: str = "float32",
                        max_tokens: int | None = None, impl: str = "local", fp8: dict | None = None,
                        packing: str | None = None, replay: bool = False):
    """On this rank: build the layout, load the HF checkpoint, compute log-probs and entropy
    of `batch` (`replay`: routed as its routed_experts say), and export the HF tensors. Returns
    (log_probs, entropy, {name: tensor} of this stage when TP rank 0 else {})."""
    from megatron.core import parallel_state

    from megarl.backends.megatron.actor import forward_log_probs
    from megarl.backends.megatron.model import Layout, build_model, export_hf_tensors, initialize, load_hf_weights
    from megarl.models import ModelSpec

    spec = ModelSpec.from_hf(hf_dir)
    layout = Layout(**layout_kw)
    layout.check(spec, torch.distributed.get_world_size(), training=False)
    initialize(layout, seed=0)
    chunks = build_model(spec, layout, dtype=dtype, impl=impl, fp8=fp8, explicit_mask=packing == "mask")
    load_hf_weights(chunks, spec, hf_dir)
    if replay:
        from megarl.backends.megatron.routing import install_replay

        install_replay(chunks)
    for chunk in chunks:
        chunk.eval()  # as the worker computes log-probs
    log_probs, entropy = forward_log_probs(chunks, spec.vocab_size, batch, micro_batch_size=micro_batch_size,
                                           max_tokens=max_tokens, packing=packing, with_entropy=True)
    exported = dict(export_hf_tensors(chunks, spec))
    keep = parallel_state.get_tensor_model_parallel_rank() == 0
    return log_probs, entropy, (exported if keep else {})


def actor_step(hf_dir: str, layout_kw: dict, batch, micro_batch_size: int, algo, optim, max_tokens=None,
               recompute=None, packing=None, replay=False):
    """One megatron optimizer step on `batch` (each DP rank takes its contiguous share of the
    rows; `replay`: routed as its routed_experts say); returns this stage's updated HF tensors
    (on TP rank 0 of DP rank 0) and the metrics."""
    from megatron.core import parallel_state

    from megarl.backends.megatron.actor import actor_step
    from megarl.backends.megatron.step import wrap_for_training
    from megarl.backends.megatron.model import Layout, build_model, export_hf_tensors, initialize, load_hf_weights
    from megarl.models import ModelSpec

    spec = ModelSpec.from_hf(hf_dir)
    layout = Layout(**layout_kw)
    initialize(layout, seed=0)
    chunks = build_model(spec, layout, recompute=recompute, explicit_mask=packing == "mask")
    load_hf_weights(chunks, spec, hf_dir)
    if replay:
        from megarl.backends.megatron.routing import install_replay

        install_replay(chunks)
    model, optimizer = wrap_for_training(chunks, optim)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    rows = len(batch) // dp
    counts = {"num_tokens": int(batch.loss_mask.sum()), "num_seqs": len(batch), "norm_length": None}
    metrics = actor_step(model, optimizer, spec.vocab_size, batch.select(slice(dp_rank * rows, (dp_rank + 1) * rows)),
                             micro_batch_size=micro_batch_size, max_tokens=max_tokens, packing=packing, algo=algo,
                             counts=counts, lr=optim.lr, weight_decay=optim.weight_decay)
    exported = dict(export_hf_tensors(chunks, spec))
    keep = parallel_state.get_tensor_model_parallel_rank() == 0 and dp_rank == 0
    return (exported if keep else {}), metrics


def worker(hf_dir: str, overrides: list[str]):
    """A MegatronTrainWorker on this rank for a run config of the tiny model."""
    from megarl.backends.megatron.worker import MegatronTrainWorker
    from megarl.config import load_config

    cfg = load_config(None, [f"model.path={hf_dir}", "model.dtype=float32", "actor.backend=megatron",
                             "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=2",
                             "actor.optim.lr=1e-3", "actor.optim.eps=1e-3", "actor.optim.lr_warmup_steps=0",
                             *overrides])
    return MegatronTrainWorker(cfg, total_steps=10)


def critic_update(hf_dir: str, overrides: list[str], batch):
    """Values before and after one critic update towards batch.returns, and its metrics."""
    w = worker(hf_dir, overrides)
    before = w.compute_values(batch)
    metrics = w.update_critic(batch.with_fields(values=before))
    return before, w.compute_values(batch), metrics


def checkpoint_phase(hf_dir: str, overrides: list[str], ckpt_dir: str, save: bool, first, second):
    """save=True: update on `first`, save, update on `second`; save=False: load instead of the
    first update and save. Returns the log-probs of `second` after the checkpoint and after
    the update on `second` (equal in both phases when weights and optimizer state round-trip)."""
    w = worker(hf_dir, overrides)
    if save:
        w.update_actor(first)
        w.save_checkpoint(ckpt_dir)
    else:
        w.load_checkpoint(ckpt_dir)
    at_checkpoint = w.compute_log_prob(second)[0]
    w.update_actor(second)
    return at_checkpoint, w.compute_log_prob(second)[0], w.actor.steps


def trained_export(hf_dir: str, overrides: list[str], update, batch, bucket_bytes: int):
    """One actor update on `update`, then what a weight sync sends: this rank's flat buckets
    as (data, entries) when it is a source rank, the trainer's checksums of every tensor, and
    the trainer's log-probs of `batch`."""
    from dataclasses import astuple

    w = worker(hf_dir, overrides)
    w.update_actor(update)
    from megarl.weights.buckets import flatten

    buckets = [(b.data, [astuple(e) for e in b.entries]) for b in map(flatten, w.export_hf_weights(bucket_bytes))]
    return (buckets if w.is_export_source else []), w.weight_checksums(), w.compute_log_prob(batch)[0]


def save_initial(hf_dir: str, ckpt_dir: str) -> None:
    """A distributed checkpoint of the untrained worker (one rank)."""
    worker(hf_dir, []).save_checkpoint(ckpt_dir)


def logprobs_from_dist(hf_dir: str, layout_kw: dict, ckpt_dir: str, batch):
    """Build the layout, load only the weights of a distributed checkpoint (as megatron does,
    no HF files read), and return the log-probs of `batch`."""
    from megatron.core import dist_checkpointing

    from megarl.backends.megatron.actor import forward_log_probs
    from megarl.backends.megatron.model import Layout, build_model, initialize
    from megarl.models import ModelSpec

    spec = ModelSpec.from_hf(hf_dir)
    layout = Layout(**layout_kw)
    initialize(layout, seed=0)
    chunks = build_model(spec, layout)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    loaded = dist_checkpointing.load({k: c.sharded_state_dict() for k, c in zip(keys, chunks)}, ckpt_dir)
    for k, c in zip(keys, chunks):
        c.load_state_dict(loaded[k], strict=False)
        c.eval()  # as the worker computes log-probs
    return forward_log_probs(chunks, spec.vocab_size, batch, micro_batch_size=2)[0]


def sleep_phase(hf_dir: str, overrides: list[str], first, second, sleep: bool):
    """Update on `first`; with `sleep`, the trainer sleeps and wakes (megarl.backends.sleep),
    checked tensor by tensor; then update on `second`. Returns (bytes of device storage freed,
    storages left on the device while asleep, tensors that differ after waking, gradient
    elements not zero after waking, the log-probs of `second` after its update)."""
    from megarl.backends.sleep import trained_tensors

    w = worker(hf_dir, overrides)

    def update(batch):
        w.update_actor(batch.with_fields(ref_log_probs=w.compute_ref_log_prob(batch)) if w.has_reference else batch)

    update(first)
    parts = [w.actor] + ([w.critic] if w.critic is not None else [])
    keep, drop = trained_tensors([c for p in parts for c in p.chunks], [p.optimizer for p in parts], w.reference or [])
    before = [t.detach().clone() for t in keep]
    freed = left = differ = nonzero = 0
    if sleep:
        storages = {s.data_ptr(): s for s in (t.untyped_storage() for t in keep + [g for g in drop if g is not None])}
        size = sum(s.nbytes() for s in storages.values())
        # megatron's own contiguous buffers, found from its DDP wrappers (not from the tensors above)
        buffers = [t for p in parts for m in p.model for b in m.buffers + m.expert_parallel_buffers
                   for t in (b.param_data, b.grad_data) if t is not None]
        assert buffers
        w.sleep()
        left = sum(s.nbytes() > 0 for s in storages.values()) + sum(t.untyped_storage().nbytes() > 0 for t in buffers)
        freed = size - sum(s.nbytes() for s in storages.values())
        w.wake()
        differ = sum(not (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
                     for a, b in zip(before, keep))
        nonzero = sum(int(torch.count_nonzero(g)) for g in drop if g is not None)
    update(second)
    return freed, left, differ, nonzero, w.compute_log_prob(second)[0]


def shares_or_whole(hf_dir: str, overrides: list[str], batch, shares: bool):
    """Log-probs of the packed `batch`, an actor update on it, and its log-probs after: sent whole
    to every rank, or (`shares`) each data-parallel rank sent only its share (megarl.backends.packed),
    as the Ray proxy sends it. Returns (log-probs before of the rows this rank computed, after,
    the update's metrics)."""
    from megarl.backends.packed import forward_shares, update_shares

    w = worker(hf_dir, overrides)
    dp_rank, dp_size = w.data_parallel()
    if shares:
        before = w.compute_log_prob(forward_shares(batch, dp_size)[dp_rank])[0]
        metrics = w.update_actor(update_shares(batch, dp_size, w.mini["actor"])[dp_rank])
    else:
        before = w.compute_log_prob(batch)[0]
        metrics = w.update_actor(batch)
    return before, w.compute_log_prob(batch)[0], metrics


def forwards_whole_and_shared(hf_dir: str, overrides: list[str], batch):
    """Log-probs of the packed `batch` sent whole to every rank, and of this rank's forward share
    (as the Ray proxy sends it; empty on a data-parallel rank beyond the batch's rows)."""
    from megarl.backends.packed import forward_shares

    w = worker(hf_dir, overrides)
    dp_rank, dp_size = w.data_parallel()
    return w.compute_log_prob(batch)[0], w.compute_log_prob(forward_shares(batch, dp_size)[dp_rank])[0]
