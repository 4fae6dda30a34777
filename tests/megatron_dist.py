"""Run a function on N local processes joined by gloo (NCCL where CUDA is), as megatron ranks.

`run_distributed(world_size, fn, *args)` returns every rank's return value (rank order; tensors, lists, dicts, numbers) or
raises with the failing rank's traceback; a hang is a failure after `timeout` seconds.
`fn` must be importable (module level): the ranks are new processes (see rank_context).
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import time
import traceback

import torch
import torch.multiprocessing as mp


# what every rank imports: the fork server imports it once, and each rank forks from it as a
# new process (no state of an earlier test) without the ~10 s a spawned rank spent importing
PRELOAD = ["torch", "transformers", "megatron.core", "megarl.backends.megatron.worker", "megatron_dist"]


def rank_context():
    """The multiprocessing context that starts rank processes (see PRELOAD). A rank's
    environment is the fork server's, taken when the first rank started: ranks set their own."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def rendezvous_store():
    """The ranks' rendezvous, held by the test process on a port the kernel gave it: a free
    port chosen first and bound later by rank 0 could be taken meanwhile (tests run in parallel)."""
    return torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def join(backend: str, port: int, rank: int, world_size: int) -> None:
    """This process as `rank` of the group whose rendezvous store listens on `port`."""
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def _entry(rank: int, world_size: int, port: int, results, fn, args) -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        if torch.cuda.is_available():  # tests/gpu: one GPU per rank
            torch.cuda.set_device(rank % torch.cuda.device_count())
        join("nccl" if torch.cuda.is_available() else "gloo", port, rank, world_size)
        buf = io.BytesIO()  # as bytes: shared-memory tensors die with the process
        torch.save(_to_cpu(fn(*args)), buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 (reported to the parent)
        results.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def run_distributed(world_size: int, fn, *args, timeout: float = 300.0) -> list:
    ctx = rank_context()
    results = ctx.Queue()
    store = rendezvous_store()
    port = store.port
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, results, fn, args), daemon=False)
             for r in range(world_size)]  # not daemonic: ranks may start helpers (checkpoint writers)
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RuntimeError(f"ranks {dead} exited with codes {[procs[r].exitcode for r in dead]} "
                                       "before giving a result") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size - len(out)} of {world_size} ranks gave no result "
                                       f"in {timeout} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=True)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]
