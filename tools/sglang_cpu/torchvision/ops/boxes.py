"""Test/CPU support stand-in for ``torchvision.ops.boxes`` (not the real torchvision),
for running SGLang 0.5.23's CPU engine without the CUDA-only torchvision wheels
(see ``torchvision/__init__.py``).

Replaces the module with functions that raise ``NotImplementedError`` when called.
"""

from torchvision import placeholder_getattr

__getattr__ = placeholder_getattr(__name__)
