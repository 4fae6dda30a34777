"""Test/CPU support for SGLang 0.5.23's LoRA serving on a machine without CUDA (not used by megarl).

SGLang's LoRA layers and its torch_native LoRA backend stage their small index tensors in pinned
host memory (`torch.empty(..., pin_memory=True)`, `tensor.pin_memory()`; sglang/srt/lora/layers.py,
backend/torch_backend.py) so that copies to the GPU can overlap compute. Pinning needs an
accelerator: without one torch raises, and `--enable-lora` stops while the model's LoRA layers are
built. On such a machine pinned and ordinary host memory behave the same for everything else, so
this module makes the tensor factories ignore `pin_memory` and `Tensor.pin_memory()` return the
tensor itself. With those two changes the CPU engine serves PEFT adapters with PEFT's log-probs
(tests/sglang_real/test_lora_adapters.py).

Imported at interpreter start-up in `.venv-sglang` by the .pth file `make sglang-env` writes; a
no-op where CUDA is available.
"""

import functools

import torch

FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "empty_like", "zeros_like", "ones_like",
             "full_like", "empty_strided")


def _ignoring_pin_memory(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)
    make.megarl_unpinned = True
    return make


def install() -> None:
    if torch.cuda.is_available():
        return
    for name in FACTORIES:
        factory = getattr(torch, name)
        if not getattr(factory, "megarl_unpinned", False):
            setattr(torch, name, _ignoring_pin_memory(factory))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


install()
