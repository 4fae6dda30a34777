"""The ipc transport (colocated engines, GPUs only): CUDA IPC handles of each flat bucket,
serialized with SGLang's own serializer, posted to the engines on the same node
(`/update_weights_from_tensor`); the engine maps the trainer's memory instead of copying
it over a link. Main entry points: `IpcTransport`, `ipc_payload`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from megarl.weights.buckets import WeightBucket
from megarl.weights.group import FLATTENED_BUCKET
from megarl.weights.routes import result
from megarl.weights.transport import TrainRanks, WeightSender, WeightTransport, needs_engine_servers

ROUTE = "/update_weights_from_tensor"


def tensor_update_body(serialized_per_tp_rank: list[str], version: int) -> dict:
    """CUDA IPC handles of one flat bucket, one base64 string per engine TP rank."""
    return {"serialized_named_tensors": list(serialized_per_tp_rank), "load_format": FLATTENED_BUCKET,
            "weight_version": str(version), "flush_cache": False}


def ipc_payload(group: Mapping[str, torch.Tensor], engine_tp: int, version: int) -> tuple[dict, torch.Tensor]:
    """(the /update_weights_from_tensor body, the buffer it points to) for one bucket of CUDA
    tensors: one packed buffer, its CUDA IPC handle serialized with SGLang's serializer (the
    engine unpickles it with SGLang's restricted unpickler), once per engine TP rank. Needs
    SGLang and CUDA; keep the buffer referenced until the engine has answered."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()  # CUDA handles name the device by UUID, not by a local index
    bucket = FlattenedTensorBucket(named_tensors=list(group.items()))
    payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    blob = MultiprocessingSerializer.serialize(payload, output_str=True)
    return tensor_update_body([blob] * engine_tp, version), payload["flattened_tensor"]


class IpcSender(WeightSender):
    """Posts each bucket's handles to the engines (url, TP) on this rank's node; a bucket
    stays alive until every engine has loaded it."""

    def __init__(self, engines: list[tuple[str, int]], timeout_s: float = 600.0):
        self.engines, self.timeout_s = list(engines), timeout_s

    def send(self, buckets: Iterable[WeightBucket], version: int) -> int:
        import httpx

        count = 0
        with httpx.Client(timeout=self.timeout_s) as client:
            for bucket in buckets:
                for url, tp in self.engines:
                    body, _buffer = ipc_payload(bucket, tp, version)  # the buffer lives until the engine answers
                    response = client.post(url + ROUTE, json=body)
                    if response.status_code != 200 or not response.json().get("success"):
                        raise RuntimeError(f"{url} failed to load a weight bucket through CUDA IPC: "
                                           f"{response.status_code} {response.text[:500]}")
                count += 1
        return count


class IpcTransport(WeightTransport):
    name = "ipc"
    request_structs = {ROUTE: "UpdateWeightsFromTensorReqInput"}

    @classmethod
    def check(cls, cfg: Any, problems: Any) -> None:
        needs_engine_servers(cls, cfg, problems)
        if cfg.rollout.engine == "local":
            return
        if not cfg.cluster.gpus_per_node:
            problems.add("sync.transport", "ipc passes CUDA memory and needs GPUs", "use nccl or disk")
        elif cfg.rollout.mode == "disaggregated":
            problems.add("sync.transport", "ipc needs the engines on the trainer's GPUs (rollout.mode=colocated)",
                         "use nccl or disk")

    def senders(self, ranks: TrainRanks) -> dict[int, WeightSender]:
        """Each source rank feeds the engines on its node; every engine needs a source of
        each pipeline stage there (CUDA IPC cannot cross nodes)."""
        sources = ranks.sources()
        targets: dict[int, list[tuple[str, int]]] = {rank: [] for rank, _ in sources}
        for server in self.engines.servers:
            local = [rank for rank, node in sources if node == server.node]
            if len(local) != len(sources):
                raise RuntimeError(f"sync.transport=ipc: engine {server.name} on node {server.node} has source ranks "
                                   f"of {len(local)} of the {len(sources)} pipeline stages on its node; CUDA IPC "
                                   "cannot cross nodes: use sync.transport=nccl")
            for rank in local:
                targets[rank].append((server.url, server.tp))
        return {rank: IpcSender(engines) for rank, engines in targets.items()}

    @staticmethod
    def add_engine_routes(app: Any, engine: Any) -> None:
        @app.post(ROUTE)
        async def update_weights_from_tensor():
            return result(False, "update_weights_from_tensor passes CUDA IPC handles, which megarl's embedded engine "
                                 "does not take: use sync.transport=nccl or disk")
