"""The files of an HF model directory: checking them before a run loads them
(`check_model_files`, `tensor_files`) and copying the non-weight ones (config, generation
config, tokenizer: `copy_config_and_tokenizer`)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from megarl.errors import RunInputError

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.safetensors.index.json", "*.bin.index.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on the JSON header


class ModelFilesError(RunInputError):
    """A model directory whose files cannot be loaded; the message names the file and what is wrong."""


def check_model_files(directory: str | Path, key: str = "model.path") -> None:
    """Everything a worker or engine will read from an HF model directory, checked in the
    driver in a second: config.json parses; each safetensors file the loaders read (those of
    model.safetensors.index.json, else model.safetensors) has a header that parses and is as
    long as its header says; every tensor of the index is in the file the index names.
    A directory with only PyTorch .bin weights passes (their format has no header to check)."""
    directory = Path(directory)
    where = f"{key}={directory}"
    if not directory.is_dir():
        raise ModelFilesError(f"{where} is not a directory; give the HF model directory (config.json + weights)")
    config = directory / "config.json"
    if not config.is_file():
        raise ModelFilesError(f"{where} is not an HF model directory (no config.json)")
    _read_json(config, where)
    if not (directory / SAFETENSORS_INDEX).exists() and not (directory / SAFETENSORS_SINGLE).exists():
        if any(directory.glob("*.bin")):
            return
        raise ModelFilesError(f"{where} holds no weights (no {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX} or *.bin)")
    tensor_files(directory, key)


def tensor_files(directory: str | Path, key: str = "model.path") -> dict[str, Path]:
    """{tensor name: safetensors file holding it} of an HF model directory, every file checked
    (`read_safetensors_header`); ModelFilesError naming the file otherwise."""
    directory = Path(directory)
    where = f"{key}={directory}"
    index = directory / SAFETENSORS_INDEX
    if index.exists():
        weight_map = _read_json(index, where).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFilesError(f"{where}: {index} has no weight_map {{tensor: file}}; copy the model again")
        headers = {}
        for name in sorted(set(weight_map.values())):
            if not (directory / name).is_file():
                raise ModelFilesError(f"{where}: {directory / name}, which {SAFETENSORS_INDEX} lists, is missing; "
                                      f"copy the model again")
            headers[name] = _header(directory / name, where)
        for tensor, name in weight_map.items():
            if tensor not in headers[name]:
                raise ModelFilesError(f"{where}: {directory / name} has no tensor {tensor}, which {SAFETENSORS_INDEX} "
                                      f"puts in it; the file and the index are from different models or copies")
        return {tensor: directory / name for tensor, name in weight_map.items()}
    single = directory / SAFETENSORS_SINGLE
    if not single.is_file():
        raise ModelFilesError(f"{where}: no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}")
    return {tensor: single for tensor in _header(single, where)}


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """{tensor name: {dtype, shape, data_offsets}} of a safetensors file (its 8-byte header
    length, the JSON header, then the tensors' bytes), checked: the header parses and the
    file is exactly as long as the header says; ModelFilesError naming the file otherwise."""
    size = path.stat().st_size
    again = "copy or download it again"
    if size < 8:
        raise ModelFilesError(f"{path} is {size} bytes, too short for a safetensors file; {again}")
    with open(path, "rb") as fh:
        (header_bytes,) = struct.unpack("<Q", fh.read(8))
        if header_bytes > MAX_HEADER_BYTES:
            raise ModelFilesError(f"{path} is not a safetensors file (its first 8 bytes give a header of "
                                  f"{header_bytes:,} bytes); {again}")
        if 8 + header_bytes > size:
            raise ModelFilesError(f"{path} is truncated: {size:,} bytes, shorter than its own header "
                                  f"({header_bytes:,} bytes); {again}")
        raw = fh.read(header_bytes)
    try:
        header = json.loads(raw.decode("utf-8"))
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        data_bytes = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, IndexError, TypeError,
            ValueError) as e:
        raise ModelFilesError(f"{path}: its safetensors header does not parse ({type(e).__name__}: {e}); "
                              f"{again}") from None
    expected = 8 + header_bytes + data_bytes
    if size < expected:
        raise ModelFilesError(f"{path} is truncated: {size:,} bytes, its header describes {expected:,}; {again}")
    if size > expected:
        raise ModelFilesError(f"{path} is {size:,} bytes, {size - expected:,} more than its header describes "
                              f"({expected:,}); {again}")
    return tensors


def _header(path: Path, where: str) -> dict[str, dict]:
    try:
        return read_safetensors_header(path)
    except ModelFilesError as e:
        raise ModelFilesError(f"{where}: {e}") from None


def _read_json(path: Path, where: str) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFilesError(f"{where}: {path} is not valid JSON ({e}); copy the model again") from None
    if not isinstance(value, dict):
        raise ModelFilesError(f"{where}: {path} is not a JSON object; copy the model again")
    return value


def copy_config_and_tokenizer(src: Path, dst: Path, dtype: str | None = None) -> None:
    """Every file of `src` but the weights into `dst`; with `dtype`, the config says it."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not any(f.match(p) for p in WEIGHT_FILES):
            shutil.copy2(f, dst / f.name)
    if dtype is not None:
        config = json.loads((dst / "config.json").read_text())
        config.pop("torch_dtype", None)
        config["dtype"] = dtype
        (dst / "config.json").write_text(json.dumps(config, indent=2))
