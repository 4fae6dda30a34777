"""The Ray actors of a run that serve without a model: the retrieval server, the reward
workers, the code rewards' sandbox services and the agent tools with `ray: true`, each in a
process of its own (placed by
megarl.runtime.ray_runtime). They live apart from the model's actors (megarl.runtime.ray_actors)
because a Ray worker imports the module of its actor's class: this one does not import torch,
which costs each process seconds of CPU while the run starts.
"""

from __future__ import annotations

import os

import ray

from megarl.config import RetrievalConfig
from megarl.reward.pool import RewardPool
from megarl.runtime.liveness import HEALTH_GROUP


@ray.remote
class RetrievalActor:
    """megarl's retrieval server (FastAPI + uvicorn, as `megarl retrieval serve`) in its own process,
    requiring `api_key` on /retrieve."""

    def __init__(self, r: RetrievalConfig, api_key: str, nnodes: int):
        from megarl.retrieval.index import load_index
        from megarl.http_server import BackgroundServer
        from megarl.retrieval.server import create_app

        host = r.host
        if host == "auto":  # reachable from the driver's node, wherever Ray placed this actor
            host = ray.util.get_node_ip_address() if nnodes > 1 else "127.0.0.1"
        self.server = BackgroundServer(create_app(load_index(r.index_dir), default_topk=r.topk, api_key=api_key),
                                       host=host, port=r.port).start()

    def url(self) -> str:
        host = self.server.host
        if host in ("0.0.0.0", "::", ""):  # bound to every interface: reach it through the node's address
            host = ray.util.get_node_ip_address()
        return f"http://{host}:{self.server.port}"

    def stop(self) -> None:
        self.server.stop()


@ray.remote
class SandboxActor:
    """A sandbox service (`megarl sandbox serve`) in its own process, bound to its node's address
    (127.0.0.1 on a one-node run), requiring `api_key` on /run."""

    def __init__(self, api_key: str, nnodes: int, wall_s: float, memory_mb: int):
        from megarl.http_server import BackgroundServer
        from megarl.reward.sandbox import Limits, LocalSandbox
        from megarl.reward.sandbox_service import create_sandbox_app

        sandbox = LocalSandbox(Limits(wall_s=wall_s, cpu_s=max(1, int(wall_s)), memory_mb=memory_mb))
        sandbox.check()  # here, so a node without bubblewrap says so at the start
        host = ray.util.get_node_ip_address() if nnodes > 1 else "127.0.0.1"
        self.server = BackgroundServer(create_sandbox_app(sandbox, api_key=api_key, max_concurrency=os.cpu_count() or 1),
                                       host=host).start()

    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


@ray.remote(max_concurrency=1000)  # async methods: the calls of every trajectory at once
class ToolActor:
    """One agent tool (agent.tools.NAME with ray: true), built from its settings in this process."""

    def __init__(self, name: str, spec: dict):
        from megarl.tools import build_tool

        self.tool = build_tool(name, spec)

    async def call(self, arguments: dict) -> tuple[bool, str]:
        from megarl.tools import call_in_actor

        return await call_in_actor(self.tool, arguments)

    def ping(self) -> int:  # megarl.runtime.liveness: started, and alive
        return 0


@ray.remote(concurrency_groups=HEALTH_GROUP)
class RewardActor:
    """A RewardPool (and its worker processes, if any) in its own process; `env`: variables its
    workers need (a sandbox service's key), set before they start."""

    def __init__(self, settings, num_workers: int, timeout_s: float, env: dict[str, str] | None = None):
        os.environ.update(env or {})
        self.pool = RewardPool(settings, num_workers=num_workers, timeout_s=timeout_s)

    def compute(self, requests):
        return self.pool.compute(requests)

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        return 0

    def close(self) -> None:
        self.pool.close()
