"""Which layer implementation a machine gets: Transformer Engine's on a GPU (an error where it
does not import, unless megatron's local layers are asked for by name), megatron's local
layers without CUDA. Main entry point: `resolve_impl`.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def transformer_engine_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def resolve_impl(requested: str, fp8: str | None = None, *, cuda: bool | None = None,
                 te: bool | None = None) -> str:
    """The layer implementation to build: on a GPU, Transformer Engine as asked (a GPU machine
    where it does not import is an error: the local layers, slower and without FP8, are asked
    for by name); without CUDA, megatron's local layers. `cuda`, `te`: what this machine has."""
    if requested not in ("transformer_engine", "local"):
        raise ValueError(f"transformer_impl {requested!r}: use transformer_engine or local")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    te = cuda and (transformer_engine_available() if te is None else te)
    if fp8 and not te:
        raise RuntimeError(f"fp8={fp8!r} needs Transformer Engine on a GPU (pip install -e '.[gpu]'); "
                           "set fp8=null to train without it")
    if requested == "transformer_engine" and not te:
        if cuda:
            raise RuntimeError("transformer_impl=transformer_engine, but Transformer Engine does not import on this "
                               "GPU machine: install it (pip install -e '.[gpu]', or an NGC PyTorch container), or "
                               "set actor.transformer_impl=local (and critic.) for megatron's local layers: slower, no FP8")
        log.info("no CUDA here: using megatron's local layer spec (Transformer Engine's layers need a GPU)")
        return "local"
    return requested
