"""Where a run's parts live: one `Runtime` interface (megarl.runtime.base), two
implementations: in this process (cluster.launcher=inprocess) and Ray actors on any number
of nodes (cluster.launcher=ray). Main entry point: `build_runtime`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl.config import RunConfig

if TYPE_CHECKING:
    from megarl.runtime.base import Runtime


def __getattr__(name: str):
    # Runtime imports torch: a process that only needs megarl.runtime.liveness or the service
    # actors (megarl.runtime.service_actors) does not import it (seconds of each Ray worker's start)
    if name == "Runtime":
        from megarl.runtime.base import Runtime

        return Runtime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_runtime(cfg: RunConfig, total_steps: int) -> Runtime:
    """Start the run's parts where cluster.launcher says (auto resolved: RunConfig.launcher)."""
    if cfg.launcher() == "ray":
        from megarl.runtime.ray_runtime import RayRuntime

        return RayRuntime(cfg, total_steps)
    from megarl.runtime.inprocess import InProcessRuntime

    return InProcessRuntime(cfg, total_steps)
