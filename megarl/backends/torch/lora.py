"""LoRA on the torch backend, through PEFT: the HF model's targeted linear layers get adapters,
everything else is frozen.

What the rest of megarl sees of an adapted model:
- `merged_hf_tensors`: the weights an engine serves, by their HF checkpoint names: every base
  tensor, with each adapted weight W replaced by W + (lora_alpha / r) B A, computed in float32
  and cast to W's dtype. The engines need no LoRA support.
- `adapter_state` / `load_adapter_state`: the adapters alone, under the names PEFT's
  adapter_model.safetensors uses (a checkpoint holds nothing else of the actor).
- `base_model`: the HF model inside (its config, its layers).
The KL reference is the same model under PEFT's `disable_adapter()`.
Main entry point: `with_adapters(model, lora)`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from megarl.backends.lora_init import initial_a
from megarl.config_lora import LoraConfig, peft_config
from megarl.models.hf_layout import checkpoint_views

ADAPTER = "default"  # PEFT's name of the one adapter megarl trains
_LORA_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def with_adapters(model: torch.nn.Module, lora: LoraConfig, seed: int = 0) -> torch.nn.Module:
    """`model` (an HF causal LM, changed in place) inside a PEFT model with `lora`'s adapters, A
    from megarl.backends.lora_init (seeded by `seed`) and B zero; only the adapters require gradients."""
    from peft import get_peft_model

    adapted = get_peft_model(model, peft_config(lora))
    with torch.no_grad():
        for name, layer in _lora_layers(adapted).items():
            a = layer.lora_A[ADAPTER].weight
            number, module = int(name.split(".")[2]), name.rsplit(".", 1)[1]  # model.layers.{i}.<part>.<module>
            a.copy_(initial_a(seed, number, module, a.shape[0], a.shape[1]))
            layer.lora_B[ADAPTER].weight.zero_()
    return adapted


def is_adapted(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model itself, adapted or not."""
    return model.get_base_model() if is_adapted(model) else model


def _lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{module name in the HF model: PEFT's LoRA layer} for every adapted layer."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in base_model(model).named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merged_weight(layer: torch.nn.Module) -> torch.Tensor:
    """W + scaling B A of one PEFT LoRA layer, in W's dtype (the sum taken in float32)."""
    w = layer.get_base_layer().weight
    a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
    delta = (b.float() @ a.float()) * layer.scaling[ADAPTER]
    return (w.float() + delta).to(w.dtype)


def merged_hf_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapted model as the engines load it: (HF checkpoint name, tensor), the adapters merged."""
    layers = _lora_layers(model)
    for name, tensor in checkpoint_views(base_model(model)).items():
        if any(part in name for part in _LORA_PARTS):
            continue
        module, sep, leaf = name.rpartition(".base_layer.")
        if not sep:
            yield name, tensor
        elif leaf == "weight":
            yield f"{module}.weight", merged_weight(layers[module])
        else:  # the base layer's bias: the adapters leave it as it is
            yield f"{module}.{leaf}", tensor


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under the names of PEFT's adapter_model.safetensors, copied to the CPU."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """The adapters of `state` (adapter_state's names) into `model`; every adapter must be there and
    nothing else (`source` names the file in the error)."""
    from peft import set_peft_model_state_dict

    expected = set(adapter_state(model))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{source} does not hold this run's adapters (actor.lora): missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    set_peft_model_state_dict(model, dict(state))
