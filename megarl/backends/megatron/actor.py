"""The megatron backend's actor: log-probs and entropy of a batch, and the policy update of
one mini-batch, both vocabulary-parallel (no rank holds full-vocabulary logits).

The loss of every micro-batch is `megarl.backends.loss.actor_loss`, the torch backend's, with
the counts of the whole mini-batch. Main entry points: `forward_log_probs`, `actor_step`.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megarl.backends.batch import TrainBatch
from megarl.backends.loss import actor_loss
from megarl.backends.megatron.forward import MicroBatch, forward_per_token, split_batch
from megarl.backends.megatron.moe_metrics import MoeMetrics
from megarl.backends.megatron.step import loss_scale, optimizer_step
from megarl.backends.vocab_logprobs import token_log_probs_from_logits
from megarl.config import AlgorithmConfig


def _token_log_probs(output: torch.Tensor, micro: MicroBatch, vocab_size: int, temperature: float,
                     with_entropy: bool):
    """This rank's vocabulary slice of the logits scored over the tensor-parallel group: no rank
    builds full-vocabulary logits (megarl.backends.vocab_logprobs)."""
    lp, ent = token_log_probs_from_logits(output, micro.targets.to(output.device), temperature=temperature,
                                          with_entropy=with_entropy, vocab_size=vocab_size,
                                          group=parallel_state.get_tensor_model_parallel_group())
    return micro.by_token(lp), (micro.by_token(ent) if with_entropy else None)


def forward_log_probs(chunks: list[torch.nn.Module], vocab_size: int, batch: TrainBatch, *, micro_batch_size: int,
                      max_tokens: int | None = None, packing: str | None = None, temperature: float = 1.0,
                      with_entropy: bool = False):
    """(log_probs, entropy or None), each (B, L) as the torch backend's `token_log_probs`:
    entry t is for token t given tokens < t, entry 0 is 0."""
    names = ("log_probs", "entropy") if with_entropy else ("log_probs",)

    def per_token(output, micro):
        lp, ent = _token_log_probs(output, micro, vocab_size, temperature, with_entropy)
        return {"log_probs": lp, "entropy": ent} if with_entropy else {"log_probs": lp}

    out = forward_per_token(chunks, batch, per_token, names, micro_batch_size=micro_batch_size, max_tokens=max_tokens,
                            packing=packing)
    return out["log_probs"], out.get("entropy")


def actor_step(model: list[torch.nn.Module], optimizer, vocab_size: int, mini: TrainBatch, *, micro_batch_size: int,
               max_tokens: int | None = None, packing: str | None = None, algo: AlgorithmConfig, counts: dict,
               lr: float, weight_decay: float, temperature: float = 1.0) -> dict[str, float]:
    """One optimizer step on `mini` (this DP rank's rows); `counts` (num_tokens, num_seqs,
    norm_length) are those of the whole mini-batch over all DP ranks."""
    micros = split_batch(mini, model[0].config, micro_batch_size=micro_batch_size, max_tokens=max_tokens,
                         packing=packing)
    scale = loss_scale(len(micros))

    def head(output, micro):
        lp, ent = _token_log_probs(output, micro, vocab_size, temperature, True)
        loss, metrics = actor_loss(lp, ent, micro.data, algo, counts)
        return loss * scale, metrics

    config = model[0].config
    if not getattr(config, "num_moe_experts", None):
        return optimizer_step(model, optimizer, micros, head, lr=lr, weight_decay=weight_decay,
                              num_tokens=counts["num_tokens"])
    with MoeMetrics(model, config.moe_router_topk, config.moe_aux_loss_coeff) as moe:
        metrics = optimizer_step(model, optimizer, micros, head, lr=lr, weight_decay=weight_decay,
                                 num_tokens=counts["num_tokens"])
    return {**metrics, **moe.metrics(micros, counts["num_tokens"])}
