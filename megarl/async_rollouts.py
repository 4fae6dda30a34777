"""Where a step's samples come from: generated when the step asks (`SyncRollouts`), or ahead of
it on a thread of their own while the trainer updates (`AsyncRollouts`, trainer.async_rollout).

The asynchronous producer generates batch k once weight version k - max_staleness is on the
engines (version v = the weights after v updates; step k trains version k), so with staleness
1 the next batch is generated while the trainer updates on the current one, and with
staleness 0 nothing overlaps: the synchronous run, step for step. Batches are made in step
order by one thread, with the same prompts and seeds as the synchronous loop, so the data
order does not depend on the mode or on timing; a checkpoint records the prompt order as it
was before the first batch it has not trained on, so a resumed run generates that batch again.

At a weight sync, generations still running wait (the sync waits for them), keep running
under the new weights, or are aborted and continued from their tokens (partial rollouts,
megarl.rollout.agent.generate_continued); every token keeps the version and log-prob of the
weights that sampled it. Main entry point: `start_rollouts`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from megarl.components import Components
from megarl.driver_loop import run_async, serve_without_signals
from megarl.experience import Sample

log = logging.getLogger(__name__)

Collect = Callable[[Components, int, dict], list[Sample]]  # (components, step, metrics) -> the step's samples


class EngineClock:
    """How long generation has been running (any batch in flight), and laps of the run's steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy_s, self._since, self._active = 0.0, 0.0, 0
        self._lap_at, self._lap_busy = time.perf_counter(), 0.0

    def start(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1

    def stop(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._busy_s += time.perf_counter() - self._since

    def busy_s(self) -> float:
        with self._lock:
            return self._busy_s + (time.perf_counter() - self._since if self._active else 0.0)

    def lap(self) -> tuple[float, float]:
        """(wall seconds, generating seconds) since the last lap (or the start)."""
        now, busy = time.perf_counter(), self.busy_s()
        lap = (now - self._lap_at, busy - self._lap_busy)
        self._lap_at, self._lap_busy = now, busy
        return lap


class SyncRollouts:
    """The synchronous loop: a step's samples are generated when it asks for them."""

    def __init__(self, c: Components, collect: Collect):
        self.c, self.collect, self.clock = c, collect, EngineClock()

    def batch(self, step: int, metrics: dict) -> list[Sample]:
        self.c.for_generation()
        self.clock.start()
        try:
            samples = self.collect(self.c, step, metrics)
        finally:
            self.clock.stop()
        self.c.for_training()
        return samples

    def regenerate(self, step: int, metrics: dict) -> list[Sample]:
        """Step `step`'s samples generated anew, now (the gate refused the first: megarl.train)."""
        return self.batch(step, metrics)

    def sync_weights(self, version: int) -> None:
        self.c.sync_weights(version)

    def published(self, version: int) -> None:
        """The step that made `version` is done (validated, logged)."""

    def order_state(self, step: int) -> dict:
        """The prompt order before step `step`'s first batch (for its checkpoint)."""
        return self.c.prompt_order.state_dict()

    def close(self) -> None:
        pass


class AsyncRollouts(SyncRollouts):
    """Batches generated ahead on a producer thread (see the module docstring)."""

    def __init__(self, c: Components, collect: Collect, first_step: int):
        super().__init__(c, collect)
        s = c.cfg.trainer.async_rollout
        self.staleness, self.partial = s.max_staleness, s.partial_rollouts
        self._cond = threading.Condition()
        self._version = first_step  # published: the engines hold it and its step is done
        self._ready: dict[int, tuple[list[Sample], dict]] = {}
        self._orders: dict[int, dict] = {}  # step -> prompt order before its first batch
        self._generating = False
        self._error: BaseException | None = None
        self._stopping = False
        c.for_generation()  # the engines' memory back and their weights probed before the producer starts
        self._thread = threading.Thread(target=serve_without_signals,
                                        args=(lambda: self._produce(first_step, c.total_steps),),
                                        name="megarl-rollouts", daemon=True)
        self._thread.start()

    def _produce(self, first: int, total: int) -> None:
        try:
            for step in range(first, total):
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping or self._version >= step - self.staleness)
                    if self._stopping:
                        return
                    self._generating = True
                    self._orders[step] = self.c.prompt_order.state_dict()
                metrics: dict = {}
                start = time.perf_counter()
                self.clock.start()
                try:
                    samples = self.collect(self.c, step, metrics)
                finally:
                    self.clock.stop()
                    metrics["timing/generate_s"] = time.perf_counter() - start
                with self._cond:
                    self._ready[step] = (samples, metrics)
                    self._generating = False
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 -- raised again in the trainer's thread
            with self._cond:
                self._error, self._generating = e, False
                self._cond.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def batch(self, step: int, metrics: dict) -> list[Sample]:
        with self._cond:
            self._cond.wait_for(lambda: step in self._ready or self._error is not None)
            self._raise_error()
            samples, produced = self._ready.pop(step)
            self._orders.pop(step - 1, None)
        metrics.update(produced)
        return samples

    def regenerate(self, step: int, metrics: dict) -> list[Sample]:
        """Step `step`'s samples generated anew, now, while the producer waits (it takes the
        prompt order too); batches it made ahead are gated at their own steps."""
        with self._cond:
            self._cond.wait_for(lambda: not self._generating or self._error is not None)
            self._raise_error()
            self.clock.start()
            try:
                return self.collect(self.c, step, metrics)
            finally:
                self.clock.stop()

    def sync_weights(self, version: int) -> None:
        if self.partial == "wait":
            with self._cond:
                self._cond.wait_for(lambda: not self._generating or self._error is not None)
                self._raise_error()
                self.c.sync_weights(version)  # under the lock: no batch starts before it is done
            return
        if self.partial == "abort":
            run_async(self.c.engine.abort_requests())  # the agent loop continues them after the sync
        self.c.sync_weights(version)

    def published(self, version: int) -> None:
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def order_state(self, step: int) -> dict:
        with self._cond:
            return self._orders[step] if step in self._orders else self.c.prompt_order.state_dict()

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        # a batch in flight ends when the run's parts are closed; the thread is a daemon


def start_rollouts(c: Components, collect: Collect, first_step: int) -> SyncRollouts:
    """The rollout source the run's config asks for (trainer.async_rollout)."""
    if c.cfg.trainer.async_rollout.enable:
        return AsyncRollouts(c, collect, first_step)
    return SyncRollouts(c, collect)
