"""Releasing a thread's OpenMP worker threads, so that the embedded engine's model thread
computes at full speed in a process whose other threads use torch too.

torch's Linux builds run their CPU kernels on GNU OpenMP (libgomp). libgomp keeps a pool of
worker threads for every thread that has run a parallel kernel, and once the pools of a process
hold more threads than it has CPUs, every worker sleeps between kernels instead of waiting
awake: each kernel then pays for waking its workers. The embedded engine runs hundreds of small
kernels per decode step on its own thread, while the thread that loaded the model (or trains it)
has a pool of its own: a one-row decode step of a tiny model took 4.2 ms instead of 1.6 ms
that way, a 10-row step 6.1 ms instead of 3.3 ms (2 CPUs, torch 2.13).

`release_openmp_workers()` frees the calling thread's pool (OpenMP 5's `omp_pause_resource_all`;
libgomp ends that thread's workers, and the thread gets a new pool at its next parallel kernel).
The engine calls it on its event loop's thread before each step, on its model thread when it
has nothing to do, and on the thread that makes it. Without an OpenMP 5 runtime behind torch
it does nothing.

Main entry point: `release_openmp_workers`.
"""

from __future__ import annotations

import ctypes
import functools
import os

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the threads end; what a program set stays set


@functools.cache
def _pause():
    """omp_pause_resource_all of the OpenMP runtime torch runs on, or None. Looked up through
    libtorch_cpu, whose dependencies resolve the name to torch's own libgomp: a process may
    hold other copies (faiss-cpu ships one), whose pools are not torch's."""
    import torch

    libtorch = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not os.path.exists(libtorch):  # not a Linux build: no libgomp there
        return None
    try:
        pause = ctypes.CDLL(libtorch).omp_pause_resource_all  # loaded already: the same library
    except (OSError, AttributeError):  # no OpenMP 5 runtime behind torch (a libgomp before GCC 9)
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


def release_openmp_workers() -> bool:
    """Free the calling thread's OpenMP worker threads (see the module docstring); True when
    libgomp did. Cheap when the thread has none. Never call it from inside a parallel region."""
    pause = _pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
