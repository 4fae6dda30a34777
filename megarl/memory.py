"""The driver's freed memory given back to the system.

glibc keeps what the process frees in its heap for later allocations, and a trajectory's arrays
(up to 80 KB for a 20,480-token response) come from that heap: after dynamic sampling drops two
thirds of a recipe's generation batch, gigabytes freed would stay resident in the driver until
it ends. `give_back` asks glibc to return the heap's free pages (`malloc_trim`); elsewhere (no
glibc) it does nothing. Main entry point: `give_back`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim():
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to call
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def give_back() -> None:
    """Return the free pages of the C heap to the system (glibc's malloc_trim(0))."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
