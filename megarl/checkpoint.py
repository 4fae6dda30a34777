"""Trainer checkpoints on disk: whole or absent, newest found on resume, last k kept.

A checkpoint is a directory `step_000042/` under `<output_dir>/checkpoints/`. It is written
into a hidden temporary directory and renamed into place only once complete (with a
`meta.json` written last inside it), so a crash mid-save leaves the previous checkpoint as
the newest. Main entry points: `save_atomically`, `latest_checkpoint`, `prune`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

META = "meta.json"
PREFIX = "step_"


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:06d}"


def save_atomically(root: str | Path, step: int, write: Callable[[Path], None], meta: dict) -> Path:
    """Call write(tmp_dir) to fill a checkpoint, add meta.json, then rename it to step_NNNNNN."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, step)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{PREFIX}{step:06d}-"))
    try:
        write(tmp)
        with open(tmp / META, "w") as fh:
            json.dump({"step": step, **meta}, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        if final.exists():  # the same step saved again (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints (with meta.json), oldest first; temporary leftovers are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / META).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_meta(checkpoint: str | Path) -> dict:
    path = Path(checkpoint) / META
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint} is not a complete megarl checkpoint (no {META})")
    return json.loads(path.read_text())


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints and any temporary leftovers; returns the deleted."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1")
    root = Path(root)
    removed = list_checkpoints(root)[:-keep]
    if root.is_dir():
        removed += [p for p in root.iterdir() if p.name.startswith(f".tmp-{PREFIX}")]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
