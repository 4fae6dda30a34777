"""megatron distributed checkpoints (the torch_dist backend: PyTorch DCP files), read one
tensor, or one layer of a layer-stacked tensor, at a time.

In such a checkpoint every weight is stored under a layout-free key with its global shape
(TP shards are chunks of it); transformer layers share one key per weight with a leading
layer axis (`decoder.layers.self_attention.linear_qkv.weight` of shape (layers, out, in)),
each layer (and each TP shard of it) a separate chunk. Chunks are `torch.save`d tensors at
byte ranges of the `__R_K.distcp` files, located by DCP's metadata. Reading a tensor
assembles its chunks, so memory stays at one tensor (one layer's slice) plus one chunk.
Main entry points: `DistCheckpoint`, `read_hf_tensors`.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import torch

from megarl.models import ModelSpec
from megarl.models.mapping import all_rules, hf_from_shards, te_name


def dist_key(megatron_name: str) -> tuple[str, int | None]:
    """(the checkpoint key, layer index or None) of a megarl.models megatron name:
    layer weights drop their layer number (it becomes the index on the stacked axis) and
    use Transformer Engine's names for the norms, as megatron's sharded state dict does."""
    name = te_name(megatron_name)
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    return (f"decoder.layers.{m[2]}", int(m[1])) if m else (name, None)


class DistCheckpoint:
    """A megatron distributed checkpoint directory (metadata.json, .metadata, *.distcp)."""

    def __init__(self, path: str | Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = Path(path)
        meta = self.path / "metadata.json"
        if not meta.exists():
            raise FileNotFoundError(f"{self.path} is not a megatron distributed checkpoint (no metadata.json)")
        backend = json.loads(meta.read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise ValueError(f"{self.path}: sharded_backend {backend!r} is not supported (only torch_dist)")
        self.metadata = FileSystemReader(str(self.path)).read_metadata()
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
                with open(self.path / info.relative_path, "rb") as fh:
                    fh.seek(info.offset)
                    return torch.load(io.BytesIO(fh.read(info.length)), weights_only=True)
        raise KeyError(f"{self.path}: no stored chunk of {key} at {offsets}")


def read_hf_tensors(dist: DistCheckpoint, spec: ModelSpec):
    """(HF name, tensor) for the whole model, one megatron tensor read at a time."""
    for rule in all_rules(spec):
        key, layer = dist_key(rule.megatron)
        yield from hf_from_shards(rule, [dist.read(key, layer)], spec).items()


def actor_checkpoint(step_dir: str | Path) -> DistCheckpoint:
    """The actor of a megarl training checkpoint (`step_NNNNNN/actor`), or `step_dir` itself
    when it is a distributed checkpoint."""
    step_dir = Path(step_dir)
    return DistCheckpoint(step_dir / "actor" if (step_dir / "actor" / "metadata.json").exists() else step_dir)
