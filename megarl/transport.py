"""Weight transports from trainer ranks to engine servers (SGLang, or megarl's embedded
server speaking the same API): the pieces both ends share.

- **nccl** (disaggregated): one process group per pipeline stage between that stage's source
  rank (rank 0) and every engine's TP ranks; each flat bucket is broadcast while the engines
  are told (`/update_weights_from_distributed`) what to receive. NCCL on GPUs, gloo where
  CUDA is absent (the CPU tests), set up exactly as SGLang's engine side does it so the two
  rendezvous (`open_update_group`).
- **disk**: each source rank writes its buckets as safetensors files into a shared
  directory; the engines then load the directory (`write_buckets`).
- **ipc** (colocated, GPU only): CUDA IPC handles of each flat bucket, serialized with
  SGLang's own serializer, posted to the engines on the same node (`ipc_payload`).

Main entry points: `open_update_group`, `broadcast_bucket`, `receive_bucket`,
`DistributedSender`, `write_buckets`, `ipc_payload`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import httpx
import torch

from megarl.rollout import sglang_api
from megarl.sync import FlatBucket, TensorEntry, flatten, unpack_bucket

log = logging.getLogger(__name__)


def open_update_group(backend: str, address: str, port: int, rank: int, world_size: int, group_name: str,
                      timeout_s: float = 600.0):
    """A process group of its own (not the default one, which megatron owns) for weight
    updates. It mirrors SGLang's `init_custom_process_group` key for key (a TCP rendezvous,
    then a store prefixed with the group name), which is what lets a trainer rank and an
    SGLang server meet in it; rank 0 hosts the store."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def close_update_group(group) -> None:
    torch.distributed.destroy_process_group(group)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def broadcast_bucket(group, bucket: FlatBucket) -> None:
    """Rank 0 sends one packed bucket to every rank of the group."""
    torch.distributed.broadcast(bucket.data, src=0, group=group)


def receive_bucket(group, names: list[str], dtypes: list[str], shapes: list[list[int]],
                   device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The receiving side of `broadcast_bucket`: the packed layout rebuilt from the names,
    dtypes and shapes alone (as SGLang's FlattenedTensorBucket does)."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(f"names, dtypes and shapes must be non-empty and equally long "
                         f"({len(names)}, {len(dtypes)}, {len(shapes)})")
    entries, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        torch_dtype = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"{name}: unknown dtype {dtype!r}")
        if any(d < 0 for d in shape):
            raise ValueError(f"{name}: negative dimension in shape {shape}")
        nbytes = torch.Size(shape).numel() * torch_dtype.itemsize
        if offset % torch_dtype.itemsize:
            raise ValueError(f"{name}: byte offset {offset} is not a multiple of {dtype}'s size")
        entries.append(TensorEntry(name, str(torch_dtype).removeprefix("torch."), tuple(shape), offset, nbytes))
        offset += nbytes
    bucket = FlatBucket(torch.empty(offset, dtype=torch.uint8, device=device), entries)
    torch.distributed.broadcast(bucket.data, src=0, group=group)
    return unpack_bucket(bucket)


class DistributedSender:
    """A source rank's end of the nccl transport: it owns the group with the engines and, for
    each bucket, tells every engine what to receive and broadcasts it.

    The HTTP calls block until the engine has received and loaded the bucket, so they run on
    threads while this rank broadcasts; a failed call raises after the broadcast (an engine
    that refused the bucket never joined it, and the broadcast fails with a timeout instead).
    """

    def __init__(self, group, engine_urls: list[str], group_name: str, timeout_s: float = 600.0):
        self.group, self.engine_urls, self.group_name = group, list(engine_urls), group_name
        self.client = httpx.Client(timeout=timeout_s)
        self.pool = ThreadPoolExecutor(max_workers=max(len(self.engine_urls), 1), thread_name_prefix="megarl-sync")

    def send(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> int:
        count = 0
        for group in buckets:
            flat = flatten(group, packed=True)
            body = sglang_api.distributed_update_body(flat.names, [e.dtype for e in flat.entries],
                                                      [list(e.shape) for e in flat.entries], self.group_name, version)
            calls = [self.pool.submit(self.client.post, url + "/update_weights_from_distributed", json=body)
                     for url in self.engine_urls]
            broadcast_bucket(self.group, flat)
            for url, call in zip(self.engine_urls, calls):
                response = call.result()
                if response.status_code != 200 or not response.json().get("success"):
                    raise RuntimeError(f"{url} failed to load a weight bucket over the update group "
                                       f"{self.group_name}: {response.status_code} {response.text[:500]}")
            count += 1
        return count

    def close(self) -> None:
        self.client.close()
        self.pool.shutdown(wait=False)
        close_update_group(self.group)


def write_buckets(buckets: Iterable[Mapping[str, torch.Tensor]], directory: str | Path, prefix: str) -> list[Path]:
    """The disk transport's writer: every bucket as `{prefix}-{i:05d}.safetensors` in
    `directory`, written under a temporary name and renamed, so a reader never sees half a file."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, group in enumerate(buckets):
        path = directory / f"{prefix}-{i:05d}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file({k: v.detach().contiguous().cpu() for k, v in group.items()}, str(tmp))
        tmp.rename(path)
        paths.append(path)
    return paths


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
    return sglang_api.tensor_update_body([blob] * engine_tp, version), payload["flattened_tensor"]
