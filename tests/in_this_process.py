"""`InThisProcess`: a ServerProcess of the test's own process where the SGLang fleet expects an
engine's Ray actor (ServerActor), for fleet tests on one server without Ray."""

from __future__ import annotations

from types import SimpleNamespace


class InThisProcess:
    """What the fleet calls on an engine's ServerActor (`await actor.alive.remote()`), answered
    by a megarl.rollout.sglang_launch.ServerProcess of this process instead of a Ray actor."""

    def __init__(self, process):
        self.process = process

    def __getattr__(self, method: str):
        call = getattr(self.process, method)

        async def remote(*args):
            return call(*args)

        return SimpleNamespace(remote=remote)
