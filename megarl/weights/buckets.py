"""Weight buckets: the unit every weight transport moves from trainer ranks to engines.

After every update, each pipeline stage's source rank (TP rank 0 of DP rank 0) gathers its
TP shards as HF-named tensors grouped into buckets of about `sync.bucket_mb`
(`export_hf_weights`, `group_tensors`). An engine in the same process takes the groups as
they are; to cross a process boundary each group is flattened (`flatten`: one contiguous
byte buffer and a manifest, so a bucket travels as one array, not hundreds of tensors) and
the engine unpacks it (`unpack_bucket`, views without copies). With `sync.verify`, the
engine's per-tensor checksums are compared with the trainer's after the sync
(`weight_checksums`, `verify_engine`). How buckets travel is the transports' business
(megarl.weights, docs/architecture.md).

Main entry points: `group_tensors`, `split_by_dtype`, `flatten`, `unpack_bucket`, `send_flat`, `weight_checksums`, `verify_engine`.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from megarl.models.hf_layout import checkpoint_views

WeightBucket = Mapping[str, torch.Tensor]  # HF parameter name -> full (unsharded) tensor

_ALIGN = 16  # byte alignment of every tensor in a bucket (views of any dtype stay aligned)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket
    nbytes: int


@dataclass
class FlatBucket:
    """HF-named tensors packed into one uint8 buffer. Pickled (Ray, multiprocessing) as a
    numpy array, which Ray's object store moves without extra copies."""
    data: torch.Tensor  # (nbytes,) uint8
    entries: list[TensorEntry]

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def __reduce__(self):
        return _rebuild_bucket, (self.data.cpu().numpy(), self.entries)


def _rebuild_bucket(array, entries: list[TensorEntry]) -> FlatBucket:
    import warnings

    with warnings.catch_warnings():  # Ray hands out read-only views; the bucket is only read
        warnings.simplefilter("ignore", UserWarning)
        return FlatBucket(torch.from_numpy(array), entries)


def group_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]],
                  bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """(name, tensor) pairs grouped, in the order given, into dicts of at most `bucket_bytes`
    (each tensor counted from an aligned start; a larger tensor gets a group of its own).
    In-process engines take these directly; `pack_buckets` flattens them."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0 (sync.bucket_mb)")
    pending: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in named_tensors:
        nbytes = _aligned(tensor.numel() * tensor.element_size())
        if pending and size + nbytes > bucket_bytes:
            yield pending
            pending, size = {}, 0
        pending[name] = tensor.detach()
        size += nbytes
    if pending:
        yield pending


def split_by_dtype(group: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """One group per dtype, in the order the dtypes first appear. SGLang rebuilds a packed
    bucket from names, dtypes and shapes alone, so a bucket whose dtypes mix can misalign
    (a tensor starting at a byte offset its dtype cannot view) and be refused after the
    trainer has started sending it; one dtype per packed bucket never misaligns."""
    by_dtype: dict[torch.dtype, dict[str, torch.Tensor]] = {}
    for name, tensor in group.items():
        by_dtype.setdefault(tensor.dtype, {})[name] = tensor
    return list(by_dtype.values())


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[FlatBucket]:
    """`group_tensors`' groups, each flattened into one buffer (for crossing processes)."""
    for group in group_tensors(named_tensors, bucket_bytes):
        yield flatten(group)


def unpack_bucket(bucket: FlatBucket) -> dict[str, torch.Tensor]:
    """{name: tensor} viewing the bucket's buffer (no copy)."""
    out = {}
    for e in bucket.entries:
        raw = bucket.data[e.offset: e.offset + e.nbytes]
        out[e.name] = raw.view(getattr(torch, e.dtype)).view(e.shape)
    return out


def send_flat(buckets: Iterable[Mapping[str, torch.Tensor]], send, wait, depth: int = 2) -> int:
    """Flatten and send every bucket with at most `depth` sends in flight, so the next bucket
    is packed while the engine loads the last. send(FlatBucket) -> handle; wait(handle)
    blocks until that bucket is loaded (and raises its error). Returns the buckets sent."""
    in_flight: list = []
    count = 0
    for bucket in buckets:
        in_flight.append(send(flatten(bucket)))
        count += 1
        if len(in_flight) >= depth:
            wait(in_flight.pop(0))
    for handle in in_flight:
        wait(handle)
    return count


def hf_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """An HF model's tensors by their checkpoint names (megarl.models.hf_layout); a tied LM head
    is left out, as HF checkpoints leave it out."""
    return iter(checkpoint_views(model).items())


def weight_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """{name: "dtype shape crc32"} of each tensor's bytes: equal exactly when the tensors are."""
    out = {}
    for name, tensor in named_tensors:
        t = tensor.detach().contiguous().cpu()
        crc = zlib.crc32(t.view(torch.uint8).reshape(-1).numpy().tobytes()) if t.numel() else 0
        out[name] = f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} {crc:08x}"
    return out


def compare_checksums(trainer: Mapping[str, str], engine: Mapping[str, str]) -> list[str]:
    """The names whose checksums differ or that only one side has (empty when in sync)."""
    return sorted(n for n in set(trainer) | set(engine) if trainer.get(n) != engine.get(n))


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def flatten(group: Mapping[str, torch.Tensor], *, packed: bool = False) -> FlatBucket:
    """One group of tensors copied into one buffer, each at a 16-byte aligned offset, or with
    `packed` back to back with no padding: SGLang's flattened_bucket layout, which the
    receiver rebuilds from names, dtypes and shapes alone (every offset must still be a
    multiple of its tensor's element size)."""
    entries, offset = [], 0
    for name, tensor in group.items():
        nbytes = tensor.numel() * tensor.element_size()
        if packed and offset % tensor.element_size():
            raise ValueError(f"{name} ({tensor.dtype}) would start at byte {offset} of a packed bucket, not a multiple "
                             f"of its element size; SGLang rejects that: send tensors of one dtype per bucket")
        entries.append(TensorEntry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
        offset += nbytes if packed else _aligned(nbytes)
    data = torch.empty(offset, dtype=torch.uint8, device=next(iter(group.values())).device)
    for tensor, e in zip(group.values(), entries):
        data[e.offset: e.offset + e.nbytes].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
    return FlatBucket(data, entries)


async def verify_engine(engine, trainer_checksums: Mapping[str, str]) -> None:
    """sync.verify: raise when the engine's weights are not exactly the trainer's."""
    engine_checksums = await engine.weight_checksums()
    if not trainer_checksums or not engine_checksums:  # nothing compared is not a pass
        side = "trainer" if not trainer_checksums else "engine"
        raise RuntimeError(f"sync.verify: the {side} reported no weight checksums, so nothing could be compared")
    differ = compare_checksums(trainer_checksums, engine_checksums)
    if differ:
        raise RuntimeError(f"sync.verify: after the weight sync the engine's weights differ from the trainer's in "
                           f"{len(differ)} tensors, e.g. {differ[:5]}")
