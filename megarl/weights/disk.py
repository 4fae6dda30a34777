"""The disk transport: each source rank writes its buckets as safetensors files into a
directory every engine can read (sync.disk_dir, shared storage across nodes), then every
engine loads the directory (SGLang's `/update_weights_from_disk`).

Slower than a process group, but it needs nothing but a shared file system, and the
newest directory is what a restarted engine reloads. Main entry points: `DiskTransport`,
`write_buckets`, `update_body`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import JSONResponse

from megarl.driver_loop import run_async
from megarl.weights.buckets import WeightBucket
from megarl.weights.routes import json_body, version_of
from megarl.weights.transport import TrainRanks, WeightSender, WeightTransport, needs_engine_servers, sources

ROUTE = "/update_weights_from_disk"  # SGLang: UpdateWeightFromDiskReqInput


def update_body(model_path: str, version: int) -> dict:
    """Load every *.safetensors file under model_path (HF names) in place. No flush of its own:
    end_weight_update flushes once every engine has its weights (a flush SGLang refuses inside
    the update would fail a call whose weights did load)."""
    return {"model_path": str(model_path), "weight_version": str(version), "flush_cache": False}


def write_buckets(buckets: Iterable[Mapping[str, torch.Tensor]], directory: str | Path, prefix: str) -> list[Path]:
    """Every bucket as `{prefix}-{i:05d}.safetensors` in `directory`, written under a
    temporary name and renamed, so a reader never sees half a file."""
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


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


class DiskSender(WeightSender):
    def __init__(self, root: str, rank: int):
        self.root, self.rank = root, rank

    def send(self, buckets: Iterable[WeightBucket], version: int) -> int:
        return len(write_buckets(buckets, version_dir(self.root, version), f"rank{self.rank:05d}"))


class DiskTransport(WeightTransport):
    name = "disk"
    request_structs = {ROUTE: "UpdateWeightFromDiskReqInput"}

    def __init__(self, cfg: Any, engines: Any):
        super().__init__(cfg, engines)
        self.root = weight_dir(cfg)

    @classmethod
    def check(cls, cfg: Any, problems: Any) -> None:
        needs_engine_servers(cls, cfg, problems)

    def senders(self, ranks: TrainRanks) -> dict[int, WeightSender]:
        return {p.rank: DiskSender(str(self.root), p.rank) for p in sources(ranks)}

    def finish(self, version: int) -> None:
        run_async(self.engines.load_from_disk(str(version_dir(self.root, version)), version))

    @staticmethod
    def add_engine_routes(app: Any, engine: Any) -> None:
        from safetensors.torch import load_file

        @app.post(ROUTE)
        async def update_weights_from_disk(request: Request):
            body = await json_body(request)
            path = Path(str(body.get("model_path", "")))
            files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
            if not files:
                return JSONResponse({"success": False, "message": f"no *.safetensors files in {path}",
                                     "num_paused_requests": 0}, status_code=400)
            try:
                await engine.update_weights((load_file(f) for f in files), version_of(body))
            except (KeyError, ValueError) as e:
                return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, status_code=400)
            return {"success": True, "message": f"loaded {len(files)} files", "num_paused_requests": 0}


def weight_dir(cfg: Any) -> Path:
    """Where weights go through disk: sync.disk_dir, or the run's output_dir/weight_sync."""
    root = Path(cfg.sync.disk_dir or Path(cfg.trainer.output_dir) / "weight_sync").resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root
