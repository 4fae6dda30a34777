"""Any megatron distributed checkpoint -> an HF model directory.

    megarl convert megatron-to-hf --ckpt DIR --out HF_DIR [--hf-config HF_DIR] [--max-shard-gb 2]

DIR is a megarl training checkpoint (`.../checkpoints/step_NNNNNN`, whose `actor/` is read),
or a distributed checkpoint directory itself (a `megarl convert hf-to-megatron` output or
megatron's), written in any TP / PP / DP layout. The HF config and tokenizer come from
--hf-config, else from the checkpoint's `hf_config/` (conversion outputs), else from the
training run's config.yaml (model.path). Tensors are read one at a time (a layer weight one
layer at a time) and written as safetensors shards of at most --max-shard-gb with an index,
one shard written while the next is read, so memory stays near two shards. The output appears
whole or not at all (written into a hidden sibling, renamed at the end); a damaged or crafted
checkpoint is refused naming its file (a training checkpoint's recorded sizes and CRC32s, the
`.distcp` lengths, `.metadata` read with only the classes DCP metadata holds). Main entry
point: `convert`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from megarl import checkpoint
from megarl.backends.megatron.dist_format import DistCheckpoint, actor_checkpoint, read_hf_tensors
from megarl.models.hf_files import copy_config_and_tokenizer
from megarl.models import ModelSpec
from megarl.models.mapping import all_rules

def find_hf_config(ckpt: Path, hf_config: str | None) -> Path:
    if hf_config:
        return Path(hf_config)
    for candidate in (ckpt / "hf_config", ckpt.parent / "hf_config"):
        if (candidate / "config.json").exists():
            return candidate
    run_config = ckpt.parent.parent / "config.yaml"  # <output_dir>/checkpoints/step_NNNNNN
    if run_config.exists():
        from megarl.config import load_config

        return Path(load_config(run_config, []).model.path)
    raise FileNotFoundError(f"no HF config for {ckpt}: pass --hf-config HF_DIR (a directory with config.json "
                            "and the tokenizer)")


def convert(ckpt: str | Path, out: str | Path, hf_config: str | None = None, max_shard_bytes: int = 2 << 30,
            progress: bool = True) -> Path:
    """Write `out` whole or not at all: into a hidden sibling, renamed to `out` at the end."""
    ckpt, out = Path(ckpt), Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; give a new directory")
    if (ckpt / checkpoint.META).is_file():  # a megarl training checkpoint: its actor's files as written?
        checkpoint.verify(ckpt, under="actor")
    dist = actor_checkpoint(ckpt)  # also checks .metadata (allow-listed classes) and the .distcp lengths
    config_dir = find_hf_config(ckpt, hf_config)
    spec = ModelSpec.from_hf(config_dir)
    rows = dist.shape("embedding.word_embeddings.weight")[0]
    if rows < spec.vocab_size or dist.shape("decoder.final_layernorm.weight") != (spec.hidden_size,):
        raise ValueError(f"{dist.path} does not hold the model of {config_dir / 'config.json'} "
                         f"({rows} embedding rows for a vocabulary of {spec.vocab_size}; hidden size "
                         f"{dist.shape('decoder.final_layernorm.weight')} vs {spec.hidden_size})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".tmp-{out.name}-"))
    try:
        dtype = write_shards(dist, spec, tmp, max_shard_bytes, progress)
        copy_config_and_tokenizer(config_dir, tmp, str(dtype).removeprefix("torch."))
        if out.exists():
            out.rmdir()  # empty (checked above): rename cannot replace it on every system
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_shards(dist: DistCheckpoint, spec: ModelSpec, out: Path, max_shard_bytes: int, progress: bool):
    """The model's HF tensors as safetensors shards and an index in `out`; returns their dtype."""
    from safetensors.torch import save_file

    shards: list[list[str]] = [[]]
    pending, size, total, dtype = {}, 0, 0, None
    names = [n for r in all_rules(spec) for n in r.hf]
    bar = tqdm(total=len(names), desc="megatron -> HF", unit="tensor", disable=not progress)
    # a shard is written on a thread while the next one is read: reading is mostly CPU
    # (unpickling chunks), writing mostly disk, so the two overlap; at most two shards in memory
    writer, writing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatron-to-hf"), None

    def flush():
        nonlocal pending, size, writing
        if pending:
            if writing is not None:
                writing.result()  # the previous shard is on disk (and its error, if any, raised here)
            writing = writer.submit(save_file, pending, str(out / f"part-{len(shards):05d}.safetensors"),
                                    metadata={"format": "pt"})
            shards[-1] = list(pending)
            shards.append([])
            pending, size = {}, 0

    try:
        for name, tensor in read_hf_tensors(dist, spec):
            nbytes = tensor.numel() * tensor.element_size()
            if pending and size + nbytes > max_shard_bytes:
                flush()
            pending[name], size, total, dtype = tensor.contiguous(), size + nbytes, total + nbytes, tensor.dtype
            bar.update(1)
        flush()
        if writing is not None:
            writing.result()
    finally:
        writer.shutdown(wait=True)
        bar.close()
    count = len(shards) - 1
    weight_map = {}
    for i, tensor_names in enumerate(shards[:-1], start=1):
        final = f"model-{i:05d}-of-{count:05d}.safetensors"
        (out / f"part-{i:05d}.safetensors").rename(out / final)
        weight_map.update({n: final for n in tensor_names})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return dtype


def main(argv: list[str] | None = None) -> int:
    """`megarl convert megatron-to-hf` (megarl.convert_command)."""
    from megarl.convert_command import module_main

    return module_main("megatron-to-hf", argv)


if __name__ == "__main__":
    sys.exit(main())
