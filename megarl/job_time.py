"""Checkpoints on time: a run saves before its job ends, and, if asked, every N minutes.

A slurm job has an end (its time limit), and a step of a 32B run can take hours: with saves
only every `trainer.save_freq` steps, a job can end before its first save, and each requeue
then starts again from step 0. So, after each step, the run asks whether the next step (as
long as the longest of the last few) and a save (as long as the last one, SAVE_GUESS_S before
the first) would still end before the job's end less `trainer.job_end_margin_s`. If not, it
saves now and stops (`JobTimeUp`, exit status EXIT_JOB_TIME): the job's requeue
(tools/ray_on_slurm.sh) or the same command resumes from that checkpoint, in the same MLflow run.

The job's end is MEGARL_JOB_END_TIME (Unix seconds; tools/ray_on_slurm.sh sets it from slurm's
EndTime) or SLURM_JOB_END_TIME (set by newer slurm releases). Without either, only
`trainer.save_freq` and `trainer.save_interval_min` save. Main entry point: `SaveClock`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Mapping

from megarl.errors import RunInputError

log = logging.getLogger(__name__)

END_TIME_VARIABLES = ("MEGARL_JOB_END_TIME", "SLURM_JOB_END_TIME")
SAVE_GUESS_S = 300.0  # a save's length before the run has timed one (a 32B distributed checkpoint takes minutes)
STEPS_REMEMBERED = 3  # the next step is taken to be as long as the longest of the last few
EXIT_JOB_TIME = 75  # EX_TEMPFAIL: stopped to save before the job's end; resumable as it is


class JobTimeUp(RuntimeError):
    """The run saved and stopped: the next step would not have ended before the job's end."""


def job_end_time(environ: Mapping[str, str] = os.environ) -> float | None:
    """The job's end in Unix seconds, from the first of END_TIME_VARIABLES set; None when none
    is. RunInputError naming the variable when its value is not a time in Unix seconds."""
    for name in END_TIME_VARIABLES:
        value = environ.get(name, "").strip()
        if not value:
            continue
        try:
            end = float(value)
        except ValueError:
            end = math.nan
        if not math.isfinite(end) or end <= 0:
            raise RunInputError(f"{name}={value!r} is not a time in Unix seconds (an hour from now: "
                                f"{int(time.time()) + 3600}); unset it or give the job's end")
        return end
    return None


class SaveClock:
    """When a run saves besides every save_freq steps: every `interval_s` seconds since the last
    save (None: never), and before `end` (Unix seconds; None: no end known) less `margin_s`."""

    def __init__(self, end: float | None, margin_s: float, interval_s: float | None,
                 now: Callable[[], float] = time.time):
        self.end, self.margin_s, self.interval_s, self.now = end, margin_s, interval_s, now
        self.last_save = now()  # the run's start counts as a save for the interval: nothing to lose before it
        self.save_s: float | None = None
        self.steps_s: deque[float] = deque(maxlen=STEPS_REMEMBERED)

    @classmethod
    def for_run(cls, trainer, environ: Mapping[str, str] = os.environ) -> SaveClock:
        """From trainer.save_before_job_end, .job_end_margin_s and .save_interval_min."""
        end = job_end_time(environ) if trainer.save_before_job_end else None
        interval = trainer.save_interval_min * 60 if trainer.save_interval_min else None
        clock = cls(end, trainer.job_end_margin_s, interval)
        if end is not None:
            left = end - clock.now()
            log.info("the job ends in %.0f s: the run saves and stops before a step that would end later than "
                     "%.0f s before it (trainer.job_end_margin_s)", left, trainer.job_end_margin_s)
        return clock

    def step_took(self, seconds: float) -> None:
        self.steps_s.append(seconds)

    def saved(self, seconds: float) -> None:
        self.save_s, self.last_save = seconds, self.now()

    def interval_due(self) -> bool:
        return self.interval_s is not None and self.now() - self.last_save >= self.interval_s

    def time_up(self) -> str | None:
        """Why the run must save and stop now (the next step and a save would end too late), else None."""
        if self.end is None or not self.steps_s:
            return None
        step_s, save_s = max(self.steps_s), self.save_s if self.save_s is not None else SAVE_GUESS_S
        left = self.end - self.margin_s - self.now()
        if step_s + save_s <= left:
            return None
        return (f"the job ends in {self.end - self.now():.0f} s: a step ({step_s:.0f} s, the longest of the last "
                f"{len(self.steps_s)}) and a save ({save_s:.0f} s{'' if self.save_s is not None else ', a guess'}) "
                f"would end past its last {self.margin_s:.0f} s (trainer.job_end_margin_s)")
