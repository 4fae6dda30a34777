"""The adapters' starting values, the same on both backends and in every layout: A as PEFT starts
it (nn.Linear's default, uniform within 1 / sqrt(in)) but drawn from a generator of its own per
layer and module (seeded by trainer.seed), B zero, so that a run starts from the base and the
torch and megatron backends take the same first steps. Main entry point: `initial_a`."""

from __future__ import annotations

import math

import torch

from megarl.config_lora import LINEAR_MODULES


def initial_a(seed: int, layer: int, module: str, rank: int, fan_in: int) -> torch.Tensor:
    """A (rank x fan_in, float32, whole) of HF module `module` (q_proj, ...) of layer `layer`."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + layer * 101 + LINEAR_MODULES.index(module)) % (1 << 63))
    bound = 1 / math.sqrt(fan_in)
    return ((torch.rand(rank, fan_in, generator=g, dtype=torch.float64) * 2 - 1) * bound).float()
