"""The OpenMP worker threads that a thread gets from running torch are released where the
embedded engine needs the CPU to itself (megarl.rollout.openmp_workers). Counted as the
process's threads in /proc/self/task: each scenario runs in a thread of its own, so its
pools are new, whatever the test process ran before."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import torch

from megarl.rollout.engine import SamplingParams
from megarl.rollout.local import LocalEngine
from megarl.rollout.openmp_workers import release_openmp_workers
from tiny_models import tiny_model

THREADS = 2  # each pool: the thread itself and one worker


def process_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_kernel() -> None:
    x = torch.ones(1 << 20)
    torch.add(x, x)  # a million elements: split over the pool's threads


def in_a_thread(scenario):
    result, errors = {}, []

    def body():
        previous = torch.get_num_threads()
        torch.set_num_threads(THREADS)
        try:
            scenario(result)
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
    def scenario(result):
        result["before"] = process_threads()
        parallel_kernel()
        result["with workers"] = process_threads()
        result["released"] = release_openmp_workers()
        result["after"] = process_threads()
        parallel_kernel()  # the next parallel kernel gets a pool again
        result["again"] = process_threads()
        release_openmp_workers()

    r = in_a_thread(scenario)
    assert r["released"] is True  # torch's Linux wheel runs on libgomp
    assert r["with workers"] == r["before"] + THREADS - 1
    assert r["after"] == r["before"]
    assert r["again"] == r["before"] + THREADS - 1


def test_the_engine_leaves_no_workers_of_its_own_or_of_its_event_loops_thread():
    model = tiny_model("qwen2")

    def scenario(result):
        async def go():
            result["before"] = process_threads()
            parallel_kernel()  # as a thread that loaded the model or trains it has workers
            assert process_threads() == result["before"] + THREADS - 1
            engine = LocalEngine(model, max_batch_size=4, eos_token_ids=[])
            try:
                await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))
                # idle now: the engine releases its model thread's workers too, on that thread
                deadline = time.monotonic() + 10
                while process_threads() > result["before"] + 1 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                result["idle"] = process_threads()
            finally:
                await engine.close()

        asyncio.run(go())

    r = in_a_thread(scenario)
    assert r["idle"] == r["before"] + 1  # the engine's model thread, without workers; this thread's gone


def test_the_thread_that_makes_the_engine_keeps_no_workers():
    # the thread that loads the model may never run the engine's event loop (it is released
    # there before each step): the engine releases it when it is made
    model = tiny_model("qwen2")

    def scenario(result):
        result["before"] = process_threads()
        parallel_kernel()
        result["with workers"] = process_threads()
        LocalEngine(model, max_batch_size=2, eos_token_ids=[])  # its loop never starts: no thread of its own yet
        result["made"] = process_threads()

    r = in_a_thread(scenario)
    assert r["with workers"] == r["before"] + THREADS - 1 and r["made"] == r["before"]
