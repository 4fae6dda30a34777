"""Test/CPU support for SGLang 0.5.23's LoRA serving on a machine without CUDA (not used by megarl).

SGLang's LoRA layers and its torch-native LoRA backend stage their small index tensors in pinned
host memory (`torch.tensor(..., pin_memory=True)`, `torch.zeros(..., pin_memory=True)`,
`tensor.pin_memory()` in sglang/srt/lora/layers.py and backend/torch_backend.py) so that copies to the GPU can overlap compute. Pinning needs an
accelerator: without one torch raises, and `--enable-lora` stops while the model's LoRA layers are
built. Without CUDA, pinned and ordinary host memory behave the same for everything else, so:

- `Tensor.pin_memory()` returns the tensor itself;
- those two modules see a `torch` whose tensor factories ignore `pin_memory`. Only those
  modules: replacing `torch.tensor` itself, for every module, changed what the CPU engine served
  (tools/sglang_cpu/smoke.py failed against transformers).

With those two changes the CPU engine serves PEFT adapters with PEFT's log-probs
(tests/sglang_real/test_lora_adapters.py). Imported at interpreter start-up in `.venv-sglang` by
the .pth file `make sglang-env` writes; a no-op where CUDA is available.
"""

import functools
import importlib.abc
import importlib.machinery
import sys
import types

import torch

MODULES = ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend")  # whose `torch` ignores pin_memory
FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange")


def _ignoring_pin_memory(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)
    return make


class _TorchWithoutPinning(types.ModuleType):
    """torch, but for its factories, which ignore pin_memory."""

    def __init__(self):
        super().__init__("torch")
        for name in FACTORIES:
            setattr(self, name, _ignoring_pin_memory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


class _Unpinning(importlib.abc.MetaPathFinder):
    """Finds MODULES as Python would, and gives each, once executed, the torch above."""

    def find_spec(self, name, path, target=None):
        if name not in MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            module.torch = _TorchWithoutPinning()

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if torch.cuda.is_available():
        return
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    if not any(isinstance(finder, _Unpinning) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Unpinning())


install()
