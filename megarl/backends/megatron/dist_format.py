"""megatron distributed checkpoints (the torch_dist backend: PyTorch DCP files), read and
written one tensor, or one layer of a layer-stacked tensor, at a time.

In such a checkpoint every weight is stored under a layout-free key with its global shape
(TP shards are chunks of it); transformer layers share one key per weight with a leading
layer axis (`decoder.layers.self_attention.linear_qkv.weight` of shape (layers, out, in)),
each layer (and each TP shard of it) a separate chunk. Chunks are `torch.save`d tensors at
byte ranges of the `__R_K.distcp` files, located by DCP's metadata. Reading a tensor
assembles its chunks, so memory stays at one tensor (one layer's slice) plus one chunk.
Writing (`write_hf_as_dist`) plans every chunk from the HF files' headers and produces each
chunk only when DCP's writer asks for it, so it never holds more than one rule's tensors.
DCP's `.metadata` index is a pickle: it is read by an allow-list unpickler (`read_dist_metadata`,
the classes DCP metadata holds and nothing else), so a crafted one is refused without running
anything; `check_dist_checkpoint` does that and more before megatron itself loads a checkpoint.
Main entry points: `DistCheckpoint`, `read_hf_tensors`, `write_hf_as_dist`, `check_dist_checkpoint`.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from pathlib import Path

import torch

from megarl.checkpoint import CheckpointError, unreadable
from megarl.models import ModelSpec
from megarl.models.mapping import all_rules, hf_from_shards, te_name


def dist_key(megatron_name: str, stacked: bool = True) -> tuple[str, int | None]:
    """(the checkpoint key, index on its leading axis or None) of a megarl.models megatron name,
    as megatron's sharded state dict names it, with Transformer Engine's names for the norms.
    `stacked` (a dense model): a layer's weights drop their layer number, which becomes the index
    on the stacked layers' axis. A mixture of experts (megatron keeps its layers apart, since
    they differ) keeps the layer number, and stacks each layer's experts: expert e of
    `…mlp.experts.local_experts.{e}.linear_fc1.weight` is index e of
    `…mlp.experts.experts.linear_fc1.weight`."""
    name = te_name(megatron_name)
    expert = re.fullmatch(r"(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(.+)", name)
    if expert:
        return f"{expert[1]}experts.{expert[3]}", int(expert[2])
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    return (f"decoder.layers.{m[2]}", int(m[1])) if m and stacked else (name, None)


class DistCheckpoint:
    """A megatron distributed checkpoint directory (metadata.json, .metadata, *.distcp)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta = self.path / "metadata.json"
        if not meta.exists():
            raise FileNotFoundError(f"{self.path} is not a megatron distributed checkpoint (no metadata.json)")
        backend = json.loads(meta.read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise ValueError(f"{self.path}: sharded_backend {backend!r} is not supported (only torch_dist)")
        self.metadata = read_dist_metadata(self.path)
        check_storage_files(self.path, self.metadata)
        self._where = {}
        for index, info in self.metadata.storage_data.items():
            self._where.setdefault(index.fqn, []).append((tuple(index.offset or ()), info))

    def keys(self) -> list[str]:
        return sorted(self.metadata.state_dict_metadata)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensor_meta(key).size)

    def read(self, key: str, layer: int | None = None) -> torch.Tensor:
        """The whole tensor `key`, or its slice `layer` on the leading (stacked layers) axis."""
        meta = self._tensor_meta(key)
        shape = tuple(meta.size)
        if layer is not None:
            if not 0 <= layer < shape[0]:
                raise KeyError(f"{self.path}: {key} has {shape[0]} layers, no layer {layer}")
            shape = shape[1:]
        whole = [c for c in meta.chunks if tuple(c.sizes) == tuple(meta.size)]
        if layer is None and whole:  # one chunk holds all of it: no copy into a new tensor
            return self._load(key, tuple(whole[0].offsets))
        out = torch.empty(shape, dtype=meta.properties.dtype)
        filled = 0
        for chunk in meta.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if layer is not None:
                if not offsets[0] <= layer < offsets[0] + sizes[0]:
                    continue
                part = self._load(key, offsets)[layer - offsets[0]]
                offsets = offsets[1:]
            else:
                part = self._load(key, offsets)
            out[tuple(slice(o, o + s) for o, s in zip(offsets, part.shape))] = part
            filled += part.numel()
        if filled != out.numel():
            raise ValueError(f"{self.path}: the chunks of {key}{'' if layer is None else f' layer {layer}'} cover "
                             f"{filled} of {out.numel()} entries (an incomplete checkpoint?)")
        return out

    def _tensor_meta(self, key: str):
        meta = self.metadata.state_dict_metadata.get(key)
        if meta is None or not hasattr(meta, "chunks"):
            raise KeyError(f"{self.path} has no tensor {key!r}")
        return meta

    def _load(self, key: str, offsets: tuple[int, ...]) -> torch.Tensor:
        for where, info in self._where.get(key, []):
            if where == offsets:
                if getattr(info, "transform_descriptors", None):
                    raise ValueError(f"{self.path}: {key} is stored with transforms {info.transform_descriptors} "
                                     "(compression?), which this reader does not undo")
                with open(self.path / info.relative_path, "rb", buffering=0) as fh:
                    window = io.BufferedReader(_FileWindow(fh, info.offset, info.length), 1 << 20)
                    try:
                        return torch.load(window, weights_only=True)
                    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
                        raise unreadable(f"{self.path / info.relative_path} (the chunk of {key} at byte "
                                         f"{info.offset})", e) from None
        raise KeyError(f"{self.path}: no stored chunk of {key} at {offsets}")


class _FileWindow(io.RawIOBase):
    """Bytes [start, start + length) of an open file as a file of their own: torch.load reads
    a chunk's storage straight from the file into the tensor (reading the chunk into a bytes
    object first would copy every byte once more)."""

    def __init__(self, fh, start: int, length: int):
        super().__init__()
        self.fh, self.start, self.length, self.pos = fh, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = base + offset
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.fh.seek(self.start + self.pos)
        got = self.fh.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got


# What a DCP `.metadata` pickle names: torch's metadata and save-plan classes (megatron keeps
# every rank's plan in it), torch.Size, dtypes and layouts, the checkpoint's path (torch's own
# save records it as a Path), and megatron's two empty marker classes of older checkpoints.
# Found by listing what real megatron, megarl and torch DCP checkpoints hold.
METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "ChunkStorageMetadata", "StorageMeta",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                             "BytesIOWriteData"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "megatron.core.dist_checkpointing.strategies.torch": {"MCoreMetadata", "MCoreSavePlan"},
}


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in METADATA_CLASSES.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def read_dist_metadata(directory: str | Path):
    """The DCP `Metadata` of a distributed checkpoint directory, unpickled with only the
    classes DCP metadata holds: a `.metadata` naming anything else (a crafted pickle whose
    reduce calls os.system) raises CheckpointError before any of it runs."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(directory) / ".metadata"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a complete distributed checkpoint (no .metadata)")
    try:
        with open(path, "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except _Refused as e:
        raise CheckpointError(f"{path} refused: it asks to load {e}, which DCP checkpoint metadata never holds "
                              "(a crafted or foreign file; nothing in it was run)") from None
    except Exception as e:  # noqa: BLE001 (a damaged pickle fails in many ways)
        raise unreadable(path, e) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP checkpoint metadata")
    return metadata


def check_storage_files(directory: Path, metadata) -> None:
    """Every .distcp file the metadata points into is there and long enough (a truncated one
    is named before anything is read from it)."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: {directory / '.metadata'} places chunks in it")
        size = path.stat().st_size
        if size < end:
            raise CheckpointError(f"{path} is truncated: {size} bytes, but {directory / '.metadata'} places chunks "
                                  f"up to byte {end}")


def check_dist_checkpoint(directory: str | Path) -> None:
    """What megatron's loader would unpickle without limits, checked first: the `.metadata`
    (allow-listed) and the stored objects (layers' extra state), which DCP loads with
    torch.load(weights_only=False) and must load with weights_only=True; the files' lengths.
    CheckpointError naming the file otherwise."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    directory = Path(directory)
    metadata = read_dist_metadata(directory)
    check_storage_files(directory, metadata)
    objects = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    for index, info in metadata.storage_data.items():
        if index.fqn not in objects:
            continue
        path = directory / info.relative_path
        with open(path, "rb") as fh:
            fh.seek(info.offset)
            data = fh.read(info.length)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
            if str(e).startswith("Weights only load failed"):
                raise CheckpointError(f"{path} refused: the stored object {index.fqn} names more than tensors and "
                                      "plain values (megatron would unpickle it in full and run it)") from None
            raise unreadable(f"{path} (the object {index.fqn} at byte {info.offset})", e) from None


def read_hf_tensors(dist: DistCheckpoint, spec: ModelSpec):
    """(HF name, tensor) for the whole model, one megatron tensor read at a time."""
    for rule in all_rules(spec):
        key, index = dist_key(rule.megatron, stacked=not spec.is_moe)
        yield from hf_from_shards(rule, [dist.read(key, index)], spec).items()


def actor_checkpoint(step_dir: str | Path) -> DistCheckpoint:
    """The actor of a megarl training checkpoint (`step_NNNNNN/actor`), or `step_dir` itself
    when it is a distributed checkpoint."""
    step_dir = Path(step_dir)
    return DistCheckpoint(step_dir / "actor" if (step_dir / "actor" / "metadata.json").exists() else step_dir)


# the linear layers' extra state megatron stores per layer (None without FP8), and Transformer
# Engine's attention (harmless to megatron's local layers, which do not ask for it)
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2",
                       "self_attention.core_attention")
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _extra_state_keys(spec: ModelSpec) -> list[str]:
    """The linear layers' extra-state objects megatron's sharded state dict holds: a dense
    model's stacked over the layers, a mixture of experts' per layer (and per expert)."""
    layers = spec.num_layers
    if not spec.is_moe:
        return [f"decoder.layers.{module}._extra_state/shard_{layer}_{layers}"
                for layer in range(layers) for module in EXTRA_STATE_MODULES]
    keys = []
    for layer in range(layers):
        for module in EXTRA_STATE_MODULES:
            if module.startswith("mlp.") and spec.is_moe_layer(layer):
                keys += [f"decoder.layers.{layer}.mlp.experts.experts.{module[4:]}._extra_state/shard_{e}_"
                         f"{spec.num_experts}" for e in range(spec.num_experts)]
            else:
                keys.append(f"decoder.layers.{layer}.{module}._extra_state/shard_0_1")
    return keys


def write_hf_as_dist(hf_dir: str | Path, out: str | Path, spec: ModelSpec, *, tp: int = 1, progress=None) -> int:
    """An HF safetensors checkpoint as a megatron distributed checkpoint of the model weights
    (the embedding padded as megatron pads it at `tp`); returns the bytes of tensors written.
    `progress`: a tqdm bar; its total is set to the bytes planned, and it advances per chunk."""
    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from megarl.backends.megatron.model import safetensors_index
    from megarl.models.mapping import shard_from_hf

    hf_dir, out = Path(hf_dir), Path(out)
    where = safetensors_index(hf_dir)
    rules = all_rules(spec)
    missing = sorted(n for r in rules for n in r.hf if n not in where)
    if missing:
        raise KeyError(f"{hf_dir}: the checkpoint has no {missing[:5]} (needed by the {spec.family} mapping)")

    def read(names, device=None):
        tensors = {}
        for n in names:
            with safe_open(where[n], framework="pt") as f:
                if device == "meta":
                    sl = f.get_slice(n)
                    tensors[n] = torch.empty(sl.get_shape(), dtype=_SAFETENSORS_DTYPES[sl.get_dtype()], device="meta")
                else:
                    tensors[n] = f.get_tensor(n)
        return tensors

    def megatron_tensor(rule, device=None):
        tensor = shard_from_hf(rule, read(rule.hf, device), spec, 0, 1)
        if rule.vocab and tensor.shape[0] < spec.padded_vocab_size(tp):
            pad = tensor.new_zeros((spec.padded_vocab_size(tp) - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        return tensor

    items, producers, layer_count = [], {}, spec.num_layers
    for rule in rules:
        # stacked: a dense model's layers on the leading axis, or a mixture of experts' experts
        key, position = dist_key(rule.megatron, stacked=not spec.is_moe)
        count = spec.num_experts if rule.expert is not None else layer_count
        meta = megatron_tensor(rule, "meta")
        if position is None:
            size, offsets, sizes = tuple(meta.shape), (0,) * meta.dim(), tuple(meta.shape)
        else:
            size, offsets, sizes = (count, *meta.shape), (position, *(0,) * meta.dim()), (1, *meta.shape)
        index = MetadataIndex(key, torch.Size(offsets))
        items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            properties=TensorProperties(dtype=meta.dtype), size=torch.Size(size))))
        producers[index] = (rule, position is not None)
    for name in _extra_state_keys(spec):
        items.append(WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO))

    class Planner(DefaultSavePlanner):
        """Plans the chunks above and makes each one only when the writer asks for it."""

        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.written = 0

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=True):
            self.state_dict, self.is_coordinator = {}, is_coordinator

        def create_local_plan(self):
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save([None], buf)  # megatron stores a list of the objects' data
                return buf
            rule, stacked = producers[write_item.index]
            tensor = megatron_tensor(rule)
            self.written += tensor.numel() * tensor.element_size()
            if progress is not None:
                progress.update(tensor.numel() * tensor.element_size())
            return tensor.unsqueeze(0) if stacked else tensor

    if progress is not None:
        progress.total = sum(i.tensor_data.chunk.sizes.numel() * i.tensor_data.properties.dtype.itemsize
                             for i in items if i.tensor_data is not None)
        progress.refresh()
    out.mkdir(parents=True, exist_ok=True)
    planner = Planner()
    # two writer threads, each making and writing the chunks of its own file: one thread's disk
    # writes overlap the other's reading and fusing (about 1.3x faster on a 2-core machine)
    save({}, storage_writer=FileSystemWriter(str(out), single_file_per_rank=True, thread_count=2), planner=planner,
         no_dist=True)
    torch.save({}, out / "common.pt")  # megatron's non-sharded part: nothing for the weights alone
    (out / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                   "common_backend": "torch", "common_backend_version": 1}))
    return planner.written
