"""Test/CPU support stand-in for ``torchvision`` (not the real one): import-only placeholders.

SGLang 0.5.23 lists torchvision as a dependency, and on its text-model path the only uses are
imports at module level: ``sglang/srt/configs/deepseek_ocr.py`` imports
``torchvision.transforms.InterpolationMode`` and ``torchvision.transforms.functional``, and once
``import torchvision`` works, transformers' image/video utilities import ``torchvision.io``,
``torchvision.transforms(.v2).functional`` and ``torchvision.ops``. The torchvision wheels on PyPI
are CUDA builds that fail to import beside the CPU torch (2.13.0) of ``.venv-sglang``, so this
package replaces them for running SGLang's CPU engine on text models only.

It provides the two enums that are used at import time (``transforms.InterpolationMode``,
``io.ImageReadMode``, with torchvision's members and values); any other name imported from these
modules is a function that raises ``NotImplementedError`` when called, so an image or video model
fails loudly instead of computing something wrong. Installed into ``.venv-sglang`` by
``make sglang-env`` through a ``.pth`` file; never used by megarl itself.
"""

import importlib

# the torchvision release that pairs with torch 2.13, with a local tag that says what this is
__version__ = "0.28.0+megarl.placeholder"


def placeholder_getattr(module_name: str):
    """A module-level ``__getattr__``: a missing name is the submodule of that name where there is
    one (``from torchvision.transforms import functional``), else a function that raises."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        try:
            return importlib.import_module(f"{module_name}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{module_name}.{name}":
                raise

        def unavailable(*args, **kwargs):
            raise NotImplementedError(
                f"{module_name}.{name}: torchvision here is an import-only placeholder "
                "(tools/sglang_cpu/torchvision); image and video models need the real torchvision"
            )

        unavailable.__name__ = unavailable.__qualname__ = name
        return unavailable

    return __getattr__


__getattr__ = placeholder_getattr(__name__)
