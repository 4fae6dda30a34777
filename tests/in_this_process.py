"""`InThisProcess`: a ServerProcess of the test's own process where the SGLang fleet expects an
engine's Ray actor (ServerActor), for fleet tests on one server without Ray."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace


class InThisProcess:
    """What the fleet calls on an engine's ServerActor (`await actor.alive.remote()`), answered
    by a megarl.rollout.sglang_launch.ServerProcess of this process instead of a Ray actor."""

    def __init__(self, process):
        self.process = process
        self.thread = ThreadPoolExecutor(1)

    def __getattr__(self, method: str):
        call = getattr(self.process, method)

        async def remote(*args):
            # in a thread of its own that lives as long as this object, as a Ray actor's methods run
            # apart (the ranks of an engine start together) in one thread: a server process gets
            # SIGKILL when the thread that started it ends (PR_SET_PDEATHSIG)
            return await asyncio.get_running_loop().run_in_executor(self.thread, call, *args)

        return SimpleNamespace(remote=remote)
