"""Bodies of the multi-process LoRA tests on the megatron backend (run by tests/megatron_dist.py
on each rank)."""

from __future__ import annotations


def lora_logprobs(hf_dir: str, layout_kw: dict, batch, lora_kw: dict, adapters_state: dict):
    """On this rank: the layout built from the HF checkpoint, PEFT-named adapters loaded, log-probs
    with the adapters and without; this stage's merged HF tensors and PEFT-named adapters (on TP
    rank 0 of DP rank 0, else {})."""
    from megatron.core import parallel_state

    from megarl.backends.megatron.actor import forward_log_probs
    from megarl.backends.megatron.lora import (adapter_hf_tensors, adapters_off, add_adapters, load_adapter_tensors,
                                               merged_hf_tensors)
    from megarl.backends.megatron.model import Layout, build_model, export_hf_tensors, initialize, load_hf_weights
    from megarl.config_lora import LoraConfig
    from megarl.models import ModelSpec

    spec = ModelSpec.from_hf(hf_dir)
    layout = Layout(**layout_kw)
    initialize(layout, seed=0)
    chunks = build_model(spec, layout)
    load_hf_weights(chunks, spec, hf_dir)
    adapters = add_adapters(chunks, spec, LoraConfig(**lora_kw), seed=0, sequence_parallel=layout.sequence_parallel)
    load_adapter_tensors(adapters, adapters_state)
    for chunk in chunks:
        chunk.eval()
    with_adapters, _ = forward_log_probs(chunks, spec.vocab_size, batch, micro_batch_size=2)
    with adapters_off(chunks):
        base, _ = forward_log_probs(chunks, spec.vocab_size, batch, micro_batch_size=2)
    merged = dict(merged_hf_tensors(export_hf_tensors(chunks, spec), adapters))
    peft = dict(adapter_hf_tensors(adapters))
    keep = parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0
    frozen = all(not p.requires_grad for n, p in chunks[0].named_parameters() if ".lora." not in n)
    trainable = sorted(n for n, p in chunks[0].named_parameters() if p.requires_grad)
    return with_adapters, base, (merged if keep else {}), (peft if keep else {}), frozen, trainable


LORA = ["actor.lora.r=4", "actor.lora.lora_alpha=8", "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1"]


def lora_worker_run(hf_dir: str, overrides: list[str], batches: list, ckpt_dir: str | None = None,
                    phase: str = "straight"):
    """A LoRA actor (megatron backend) on this rank. phase "straight": an update on each batch;
    "save": the first update, a checkpoint, then the rest; "load": the checkpoint, then the rest.
    Returns (the stage's PEFT-named adapters on its source rank else {}, the trainer's log-probs and
    reference log-probs of the last batch, whether the checkpoint holds adapters alone)."""
    from megarl.backends.megatron.lora import adapter_hf_tensors
    from megatron_cases import worker

    w = worker(hf_dir, LORA + overrides)
    todo = list(batches)

    def update(batch):
        w.update_actor(batch.with_fields(ref_log_probs=w.compute_ref_log_prob(batch)))

    if phase == "save":
        update(todo.pop(0))
        w.save_checkpoint(ckpt_dir)
    elif phase == "load":
        w.load_checkpoint(ckpt_dir)
        todo.pop(0)
    for batch in todo:
        update(batch)
    if w.cfg.actor.lora.sync == "adapter":  # what the lora transport sends (every rank walks the export)
        adapters = {n: t for bucket in w.export_hf_weights(1 << 20) for n, t in bucket.items()}
    else:
        adapters = dict(adapter_hf_tensors(w.adapters))
    last = batches[-1]
    return (adapters if w.is_export_source else {}), w.compute_log_prob(last)[0], w.compute_ref_log_prob(last)
