"""Test/CPU support stand-in for ``torchvision.io`` (not the real torchvision),
for running SGLang 0.5.23's CPU engine without the CUDA-only torchvision wheels
(see ``torchvision/__init__.py``).

Replaces the module with ``ImageReadMode`` (torchvision's enum) and functions that raise.
"""

from enum import Enum

from torchvision import placeholder_getattr


class ImageReadMode(Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


__getattr__ = placeholder_getattr(__name__)
