"""The non-weight files of an HF model directory (config, generation config, tokenizer)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.safetensors.index.json", "*.bin.index.json")


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
