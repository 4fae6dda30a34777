"""Scoring a batch of rewards in persistent worker processes, with a time limit on every
call, so that no reward can hang or crash the trainer.

Main entry point: `RewardPool(cfg, num_workers, timeout_s).compute(requests)`.

Two layers of time limit:
- in the worker, every call runs under SIGALRM (megarl.reward.timeout): a Python-level
  hang becomes a timeout result after timeout_s;
- in the parent, a worker that has not answered for timeout_s + grace_s is stuck where
  the alarm cannot reach (inside C code, or with SIGALRM blocked): it is SIGKILLed, its
  current request is recorded as a timeout, the rest of its chunk goes back in the
  queue, and a fresh worker takes its place.
Failures score 0, are counted in RewardStats and logged (the first few per batch); they
never raise. Every request gets exactly one result, in input order.

Workers are started with "spawn" (or "forkserver"), never "fork": the trainer has
threads (Ray, NCCL, tokenizers) and a forked copy of a locked mutex deadlocks. Each
worker talks to the parent through its own pipe, so killing one cannot corrupt a lock
shared with the others.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import selectors
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Protocol

from megarl.reward.scoring import (
    RewardRequest,
    RewardResult,
    apply_group_rewards,
    failed_result,
    score_one,
    warm_up,
)
from megarl.reward.settings import RewardConfig
from megarl.reward.timeout import RewardTimeout, alarm_available, call_with_timeout

logger = logging.getLogger(__name__)

LOGGED_FAILURES_PER_BATCH = 3
_MAX_ERROR_CHARS = 500
# Chunks amortise the parent → worker messages; a few chunks per worker and batch keep
# the load balanced when some responses are much slower to score than others.
_MAX_CHUNK_SIZE = 64
_CHUNKS_PER_WORKER = 4
# A worker sends its results in batches at most this old: one message per cheap reward
# costs the parent as much as scoring it, and the parent shares the cores with the workers.
_RESULT_FLUSH_S = 0.02


@dataclass(frozen=True)
class RewardStats:
    num_requests: int
    num_timeouts: int
    num_errors: int
    """Reward calls that raised, or whose worker died (timeouts not included)."""
    num_workers_replaced: int
    seconds: float


class RewardComputer(Protocol):
    """What the trainer uses of a reward pool: `RewardPool` here, or its proxy in a Ray
    actor (megarl.runtime.ray_proxies.RemoteRewardPool)."""

    def compute(self, requests: list[RewardRequest]) -> tuple[list[RewardResult], RewardStats]:
        """Score every request; results in input order, one per request; never raises for
        a failed reward (it scores 0 and is counted in the stats)."""

    def close(self) -> None: ...


def score_guarded(cfg: RewardConfig, request: RewardRequest, timeout_s: float | None) -> RewardResult:
    """score_one under the alarm; a timeout or an exception becomes a failed result."""
    try:
        return call_with_timeout(lambda: score_one(cfg, request), timeout_s)
    except RewardTimeout:
        return failed_result(f"timed out after {timeout_s} s", timed_out=True)
    except Exception as error:  # a broken reward function must not stop training
        return failed_result(f"{type(error).__name__}: {error}"[:_MAX_ERROR_CHARS])


def _worker_main(conn: Connection, cfg: RewardConfig, timeout_s: float) -> None:
    """Worker loop: receive chunks of (index, request), send back results in small batches
    (before each request, whatever is older than _RESULT_FLUSH_S; the rest at chunk end)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        warm_up(cfg)
    except BaseException as error:
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            chunk = conn.recv()
        except EOFError:  # the parent is gone
            return
        if chunk is None:
            return
        done, last_flush = [], time.monotonic()
        for index, request in chunk:
            if done and time.monotonic() - last_flush >= _RESULT_FLUSH_S:
                conn.send(("results", done))
                done, last_flush = [], time.monotonic()
            done.append((index, score_guarded(cfg, request, timeout_s)))
        conn.send(("results", done))


class _Worker:
    """One worker process as the parent sees it: its pipe, and the requests it holds
    (in the order it scores them, so pending[0] is the one it is working on)."""

    def __init__(self, context, cfg: RewardConfig, timeout_s: float):
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_worker_main, args=(child_conn, cfg, timeout_s), name="megarl-reward-worker", daemon=True
        )
        self.process.start()
        child_conn.close()
        self.ready = False
        self.retired = False
        self.pending: deque[int] = deque()
        self.last_answer = time.monotonic()

    def read(self, results: list[RewardResult | None]) -> tuple[int, bool]:
        """Take one message (the pipe is readable); returns (results stored, still alive)."""
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            return 0, False
        self.last_answer = time.monotonic()
        if kind == "results":
            for index, result in payload:
                results[index] = result
                if self.pending and self.pending[0] == index:  # results come in dispatch order
                    self.pending.popleft()
                else:
                    self.pending.remove(index)
            return len(payload), True
        if kind == "ready":
            self.ready = True
            return 0, True
        raise RuntimeError(f"a reward worker failed to start: {payload}")

    def drain(self, results: list[RewardResult | None]) -> tuple[int, bool]:
        """Take every message waiting in the pipe; returns (results stored, still alive)."""
        stored = 0
        while self.conn.poll():
            count, alive = self.read(results)
            stored += count
            if not alive:
                return stored, False
        return stored, self.process.is_alive()

    def stop(self, kill: bool) -> None:
        if kill:
            self.process.kill()
        else:
            try:
                self.conn.send(None)
            except OSError:
                pass
        self.process.join(timeout=5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class RewardPool:
    """Persistent reward workers; `compute(requests) -> (results, stats)`.

    cfg is the reward settings (a run config's `reward` section, RunConfig.reward).
    num_workers=0 scores in the calling process (with the alarm when called from the
    main thread; without a time limit otherwise). Use as a context manager or call
    close(); the workers are daemons, so they also end with the trainer.
    """

    def __init__(
        self,
        cfg: RewardConfig,
        num_workers: int,
        timeout_s: float = 10.0,
        grace_s: float = 5.0,
        chunk_size: int | None = None,
        start_method: str = "spawn",
        startup_timeout_s: float = 300.0,
    ):
        if num_workers < 0:
            raise ValueError(f"RewardPool num_workers={num_workers} must be >= 0 (0 = score in this process)")
        if timeout_s <= 0 or grace_s < 0:
            raise ValueError(f"RewardPool timeout_s={timeout_s} must be > 0 and grace_s={grace_s} >= 0")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"RewardPool chunk_size={chunk_size} must be >= 1 or None (automatic)")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(
                f"RewardPool start_method={start_method!r} is not supported; use 'spawn' or 'forkserver' "
                "('fork' can deadlock a process that runs threads)"
            )
        self.cfg, self.num_workers = cfg, num_workers
        self.timeout_s, self.grace_s, self.chunk_size = timeout_s, grace_s, chunk_size
        self._context = multiprocessing.get_context(start_method)
        self._closed = False
        self._warned_no_alarm = False
        cfg.validate()  # settings changed after they were built are checked here
        warm_up(cfg)  # a bad custom_function fails here, in the caller, with its own message
        # One selector for the life of the pool: building one per wait costs as much as
        # scoring a cheap reward.
        self._selector = selectors.DefaultSelector()
        # requests that were in a worker that hung or died together with others: each is
        # re-sent alone, so that the one to blame is known (results are sent in batches)
        self._suspects: set[int] = set()
        self._workers = [self._start_worker() for _ in range(num_workers)]
        self._wait_until_ready(startup_timeout_s)

    def _start_worker(self) -> _Worker:
        worker = _Worker(self._context, self.cfg, self.timeout_s)
        self._selector.register(worker.conn, selectors.EVENT_READ, worker)
        self._selector.register(worker.process.sentinel, selectors.EVENT_READ, worker)
        return worker

    def _stop_worker(self, worker: _Worker, kill: bool) -> None:
        self._selector.unregister(worker.conn)
        self._selector.unregister(worker.process.sentinel)
        worker.stop(kill)

    def _wait_until_ready(self, startup_timeout_s: float) -> None:
        deadline = time.monotonic() + startup_timeout_s
        while not all(worker.ready for worker in self._workers):
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"reward workers did not start within {startup_timeout_s} s")
            wait([w.conn for w in self._workers if not w.ready], timeout=1.0)
            for worker in self._workers:
                try:
                    _, alive = worker.drain([])
                except RuntimeError:
                    self.close()
                    raise
                if not alive:
                    code = worker.process.exitcode
                    self.close()
                    raise RuntimeError(f"a reward worker exited during start-up (exit code {code})")

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers; idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            self._stop_worker(worker, kill=bool(worker.pending))
        self._selector.close()

    def compute(self, requests: list[RewardRequest]) -> tuple[list[RewardResult], RewardStats]:
        """Score every request; results in input order, one per request."""
        if self._closed:
            raise RuntimeError("RewardPool.compute called after close(); create a new pool")
        started = time.monotonic()
        requests = list(requests)
        replaced = 0
        if self.num_workers == 0:
            if not alarm_available() and not self._warned_no_alarm:
                logger.warning("RewardPool(num_workers=0) off the main thread scores without a time limit")
                self._warned_no_alarm = True
            results = [score_guarded(self.cfg, request, self.timeout_s) for request in requests]
        else:
            try:
                results, replaced = self._compute_in_workers(requests)
            except BaseException:
                # Workers may still hold chunks of this batch; their late results must not
                # leak into a later batch, so the pool is closed.
                self.close()
                raise
        results = apply_group_rewards(self.cfg, requests, results)
        stats = RewardStats(
            num_requests=len(requests),
            num_timeouts=sum(result.timed_out for result in results),
            num_errors=sum(result.error is not None and not result.timed_out for result in results),
            num_workers_replaced=replaced,
            seconds=time.monotonic() - started,
        )
        _log_failures(requests, results)
        return results, stats

    def _auto_chunk_size(self, num_requests: int) -> int:
        if self.chunk_size is not None:
            return self.chunk_size
        per_chunk = math.ceil(num_requests / (self.num_workers * _CHUNKS_PER_WORKER))
        return max(1, min(_MAX_CHUNK_SIZE, per_chunk))

    def _compute_in_workers(self, requests: list[RewardRequest]) -> tuple[list[RewardResult], int]:
        results: list[RewardResult | None] = [None] * len(requests)
        todo = deque(range(len(requests)))
        chunk_size = self._auto_chunk_size(len(requests))
        limit_s = self.timeout_s + self.grace_s
        remaining, replaced = len(requests), 0
        while remaining:
            for worker in self._workers:
                if worker.ready and not worker.pending and todo:
                    self._dispatch(worker, todo, chunk_size, requests)
            next_deadline = min(
                (w.last_answer + limit_s for w in self._workers if w.pending), default=time.monotonic() + 1.0
            )
            events = self._selector.select(max(0.0, next_deadline - time.monotonic()) + 0.01)
            for key, _ in events:
                worker = key.data
                if worker.retired:  # replaced earlier in this round
                    continue
                if key.fileobj is worker.conn:
                    stored, alive = worker.read(results)
                else:  # the sentinel: the process ended; keep what it sent before
                    stored, alive = worker.drain(results)
                remaining -= stored
                if not alive:
                    remaining -= self._replace_dead(worker, todo, results)
                    replaced += 1
            now = time.monotonic()
            for worker in [w for w in self._workers if w.pending and now - w.last_answer > limit_s]:
                stored, alive = worker.drain(results)  # a result may have just arrived
                remaining -= stored
                if not alive:
                    remaining -= self._replace_dead(worker, todo, results)
                elif worker.pending and time.monotonic() - worker.last_answer > limit_s:
                    error = (f"reward worker did not answer for {limit_s:.1f} s (stuck where the alarm cannot "
                             "interrupt, e.g. in C code); it was killed")
                    remaining -= self._replace(worker, todo, results, error, timed_out=True)
                else:
                    continue
                replaced += 1
        return results, replaced

    def _dispatch(self, worker: _Worker, todo: deque[int], chunk_size: int, requests: list[RewardRequest]) -> None:
        if todo[0] in self._suspects:
            chunk = [todo.popleft()]
            self._suspects.discard(chunk[0])
        else:
            chunk = [todo.popleft() for _ in range(min(chunk_size, len(todo)))]
        try:
            worker.conn.send([(index, requests[index]) for index in chunk])
        except OSError:  # the worker just died; it is replaced once its sentinel fires
            todo.extendleft(reversed(chunk))
            return
        except Exception as error:
            raise TypeError(
                f"reward requests {chunk[0]}..{chunk[-1]} cannot be sent to a reward worker ({error}); "
                "ground_truth and extra_info must be picklable"
            ) from error
        worker.pending.extend(chunk)
        worker.last_answer = time.monotonic()

    def _replace_dead(self, worker: _Worker, todo: deque[int], results: list[RewardResult | None]) -> int:
        if not worker.ready:  # a replacement that cannot start would be restarted forever
            raise RuntimeError(
                f"a replacement reward worker exited during start-up (exit code {worker.process.exitcode})"
            )
        worker.process.join(timeout=5.0)  # reaped, so that its exit code is known
        error = f"reward worker died (exit code {worker.process.exitcode}) while scoring this request"
        return self._replace(worker, todo, results, error, timed_out=False)

    def _replace(
        self, worker: _Worker, todo: deque[int], results: list[RewardResult | None], error: str, timed_out: bool
    ) -> int:
        """Start a replacement. A worker that held one request: that request failed. One
        that held several: which one hung is unknown (unsent results are batched), so they
        are re-queued as suspects, each to be re-sent alone. Returns results stored (0 or 1)."""
        stored = 0
        if len(worker.pending) == 1:
            results[worker.pending.popleft()] = failed_result(error, timed_out=timed_out)
            stored = 1
        elif worker.pending:
            self._suspects.update(worker.pending)
            todo.extendleft(reversed(worker.pending))
            worker.pending.clear()
        self._stop_worker(worker, kill=True)
        worker.retired = True
        self._workers[self._workers.index(worker)] = self._start_worker()
        return stored


def _log_failures(requests: list[RewardRequest], results: list[RewardResult]) -> None:
    failures = [(index, result) for index, result in enumerate(results) if result.error is not None]
    for index, result in failures[:LOGGED_FAILURES_PER_BATCH]:
        logger.warning(
            "reward of request %d (data_source=%r) scored 0: %s", index, requests[index].data_source, result.error
        )
    if len(failures) > LOGGED_FAILURES_PER_BATCH:
        logger.warning("%d more reward failures in this batch", len(failures) - LOGGED_FAILURES_PER_BATCH)
