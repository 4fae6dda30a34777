"""An HF model's tensors under the names and shapes of its checkpoint.

megarl names weights as HF checkpoints do, everywhere (the mapping, weight sync, conversion,
SGLang's loader). transformers 5 keeps some models differently in memory: a Qwen3-MoE layer
holds all its experts in two 3-D parameters, `mlp.experts.gate_up_proj` (experts x 2I x H,
each expert's gate rows then its up rows) and `mlp.experts.down_proj` (experts x H x I), where
the checkpoint has `mlp.experts.{e}.gate_proj.weight`, `.up_proj.weight` and
`.down_proj.weight`. `checkpoint_views` translates at the model's edge, with views that share
the parameters' memory: reading them exports the weights, copying into them loads new ones.
A model already stored by expert (older transformers) is passed through unchanged.

Main entry point: `checkpoint_views(model)`.
"""

from __future__ import annotations

import torch

_GATE_UP, _DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def checkpoint_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{checkpoint name: a detached view of the model's tensor}, in the model's order; a tied
    LM head is left out, as HF checkpoints leave it out."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        if name.endswith(_GATE_UP) and tensor.dim() == 3:
            prefix = name[: -len("gate_up_proj")]
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}{e}.up_proj.weight"] = up[e]
        elif name.endswith(_DOWN) and tensor.dim() == 3:
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out
