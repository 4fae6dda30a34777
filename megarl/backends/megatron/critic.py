"""The megatron backend's critic: the policy's GPTModel with a one-dimensional value head in
place of the output layer, and its clipped value-loss update.

values[:, t] is the value of the state before token t, read from the hidden state at
position t − 1, as the torch backend's `ValueModel` (megarl.backends.torch.critic): values,
log-probs and advantages share one alignment. The head is a plain Linear(hidden, 1)
replicated on every TP rank and zero-initialised (V = 0 at first, so early advantages are
the rewards themselves). Main entry points: `build_critic`, `forward_values`, `critic_step`.
"""

from __future__ import annotations

import torch

from megarl.algo import value_loss
from megarl.backends.batch import TrainBatch
from megarl.backends.megatron.forward import forward_per_token, split_batch
from megarl.backends.megatron.step import loss_scale, optimizer_step

VALUE_HEAD = ("output_layer.weight", "output_layer.bias")


class ValueHead(torch.nn.Module):
    """Stands in for GPTModel.output_layer: hidden (S, B, H) -> values (S, B, 1).

    With sequence parallelism the hidden states arrive split along the sequence; they are
    gathered first, and since every TP rank computes the same loss from the same values,
    the backward pass only splits the gradient again (no reduction across TP)."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype, device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def build_critic(spec, layout, **build_kw) -> list[torch.nn.Module]:
    """This rank's critic chunks: untied GPTModel chunks whose last stage ends in a ValueHead."""
    from dataclasses import replace

    from megarl.backends.megatron.model import build_model

    chunks = build_model(replace(spec, tied_embeddings=False), layout, **build_kw)
    for chunk in chunks:
        if chunk.post_process:
            weight = chunk.output_layer.weight
            chunk.output_layer = ValueHead(spec.hidden_size, layout.sequence_parallel, weight.dtype, weight.device)
    return chunks


def forward_values(chunks: list[torch.nn.Module], batch: TrainBatch, *, micro_batch_size: int,
                   max_tokens: int | None = None, packing: str | None = None) -> torch.Tensor:
    """(B, L) values, entry 0 and padding zero."""
    def per_token(output, micro):
        return {"values": micro.by_token(output[..., 0].float())}

    return forward_per_token(chunks, batch, per_token, ("values",), micro_batch_size=micro_batch_size,
                             max_tokens=max_tokens, packing=packing)["values"]


def critic_step(model: list[torch.nn.Module], optimizer, mini: TrainBatch, *, micro_batch_size: int,
                max_tokens: int | None = None, packing: str | None = None, cliprange_value: float, loss_agg_mode: str, counts: dict, lr: float,
                weight_decay: float) -> dict[str, float]:
    """One optimizer step of the clipped value loss towards mini.returns around mini.values."""
    micros = split_batch(mini, model[0].config, micro_batch_size=micro_batch_size, max_tokens=max_tokens,
                         packing=packing)
    scale = loss_scale(len(micros))

    def head(output, micro):
        d = micro.data
        values = micro.by_token(output[..., 0].float())
        loss, metrics = value_loss(values, d.values.to(values.device), d.returns.to(values.device),
                                   d.loss_mask.to(values.device), cliprange_value, loss_agg_mode, **counts)
        return loss * scale, metrics

    return optimizer_step(model, optimizer, micros, head, lr=lr, weight_decay=weight_decay,
                          num_tokens=counts["num_tokens"])
