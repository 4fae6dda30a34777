"""Test/CPU support stand-in for ``torchvision.transforms`` (not the real torchvision),
for running SGLang 0.5.23's CPU engine without the CUDA-only torchvision wheels
(see ``torchvision/__init__.py``).

Replaces the module with ``InterpolationMode`` (torchvision's enum) and functions that raise.
"""

from enum import Enum

from torchvision import placeholder_getattr


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = placeholder_getattr(__name__)
