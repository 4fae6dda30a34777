"""megarl.memory.give_back: what the driver freed leaves its resident memory."""

import subprocess
import sys

CHILD = r"""
import psutil
from megarl import memory

rss = lambda: psutil.Process().memory_info().rss
blocks = [bytearray(b"x" * 60_000) for _ in range(3000)]  # 180 MB of trajectory-sized arrays, on the C heap
pin = bytearray(b"x" * 60_000)  # in use above them: glibc does not trim the heap's top by itself
before = rss()
del blocks
freed = rss()
memory.give_back()
print(before, freed, rss())
"""


def test_freed_trajectory_sized_arrays_leave_the_resident_memory():
    before, freed, after = map(int, subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                                                   check=True, timeout=120).stdout.split())
    assert before - freed < 20e6  # freed, but kept by the allocator
    assert freed - after > 150e6  # given back
