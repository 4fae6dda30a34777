"""The OpenMP worker threads that a thread gets from running torch are released where the
embedded engine needs the CPU to itself (megarl.rollout.openmp_workers).

Each scenario runs in a thread of its own with an OS thread name of its own. The threads it
starts (its OpenMP workers, the engine's model thread and that thread's workers) inherit the
name, so the process's threads of that name (/proc/self/task/*/comm) are its own threads, whatever
other threads the test process runs or ends meanwhile. (torch.set_num_threads starts a thread
pool of another kind, pthreadpool, once: counts are taken relative to the scenario's start.)"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import os
import threading
import time

import torch

from megarl.rollout.engine import SamplingParams
from megarl.rollout.local import LocalEngine
from megarl.rollout.openmp_workers import release_openmp_workers
from tiny_models import tiny_model

THREADS = 2  # each pool: the thread itself and one worker
PR_SET_NAME = 15
NAMES = (f"omp-probe-{i}" for i in itertools.count())


def threads_named(name: str) -> int:
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().strip() == name
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return count


def settled(own_threads, expected: int, timeout_s: float = 10.0) -> int:
    """own_threads() once it is `expected` (or the deadline passed): a released worker is told to
    end, and leaves /proc a moment after the call that ended it returns."""
    deadline = time.monotonic() + timeout_s
    while (count := own_threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


def parallel_kernel() -> None:
    x = torch.ones(1 << 20)
    torch.add(x, x)  # a million elements: split over the pool's threads


def in_a_thread(scenario):
    """Runs scenario(result, own_threads) in a new named thread; own_threads() counts the
    threads of that name."""
    result, errors, name = {}, [], next(NAMES)

    def body():
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode(), 0, 0, 0)  # inherited by the threads it starts
        previous = torch.get_num_threads()
        torch.set_num_threads(THREADS)  # which may start the thread's pool already
        release_openmp_workers()  # the scenario starts without one
        try:
            scenario(result, lambda: threads_named(name))
        except BaseException as e:
            errors.append(e)
        finally:
            torch.set_num_threads(previous)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result


def test_a_threads_workers_end_when_it_releases_them():
    def scenario(result, own_threads):
        result["before"] = own_threads()
        parallel_kernel()
        result["with workers"] = own_threads()
        result["released"] = release_openmp_workers()
        result["after"] = settled(own_threads, result["before"])
        parallel_kernel()  # the next parallel kernel gets a pool again
        result["again"] = own_threads()
        release_openmp_workers()

    r = in_a_thread(scenario)
    assert r["released"] is True  # torch's Linux wheel runs on libgomp
    assert r["with workers"] == r["before"] + THREADS - 1
    assert r["after"] == r["before"]
    assert r["again"] == r["before"] + THREADS - 1


def test_the_engine_leaves_no_workers_of_its_own_or_of_its_event_loops_thread():
    model = tiny_model("qwen2")

    def scenario(result, own_threads):
        async def go():
            result["before"] = own_threads()
            parallel_kernel()  # as a thread that loaded the model or trains it has workers
            result["with workers"] = own_threads()
            engine = LocalEngine(model, max_batch_size=4, eos_token_ids=[])
            try:
                await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))
                # idle now: the engine releases its model thread's workers too, on that thread
                deadline = time.monotonic() + 10
                while own_threads() != result["before"] + 1 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                result["idle"] = own_threads()
            finally:
                await engine.close()

        asyncio.run(go())

    r = in_a_thread(scenario)
    assert r["with workers"] == r["before"] + THREADS - 1
    assert r["idle"] == r["before"] + 1  # the engine's model thread; neither it nor this thread has workers


def test_the_thread_that_makes_the_engine_keeps_no_workers():
    # the thread that loads the model may never run the engine's event loop (it is released
    # there before each step): the engine releases it when it is made
    model = tiny_model("qwen2")

    def scenario(result, own_threads):
        result["before"] = own_threads()
        parallel_kernel()
        result["with workers"] = own_threads()
        LocalEngine(model, max_batch_size=2, eos_token_ids=[])  # its loop never starts: no thread of its own yet
        result["made"] = settled(own_threads, result["before"])

    r = in_a_thread(scenario)
    assert r["with workers"] == r["before"] + THREADS - 1 and r["made"] == r["before"]


def test_the_release_reaches_torchs_openmp_when_another_copy_is_loaded_first():
    # faiss-cpu ships its own libgomp; a process that imported it holds two, and only torch's
    # pools matter (the first version of this code looked the function up in the first copy)
    import faiss  # noqa: F401  (loads its libgomp)

    from megarl.rollout import openmp_workers

    with open("/proc/self/maps") as maps:
        copies = {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}
    assert len(copies) >= 2, copies  # else this test tests nothing new: faiss-cpu's wheel changed
    openmp_workers._pause.cache_clear()

    def scenario(result, own_threads):
        result["before"] = own_threads()
        parallel_kernel()
        release_openmp_workers()
        result["after"] = settled(own_threads, result["before"])

    r = in_a_thread(scenario)
    assert r["after"] == r["before"]
