"""The lora transport (actor.lora.sync=adapter): the engines keep the frozen base they started
with and get the trained LoRA adapters alone, a few hundred MB at 32B where the merged model is
64 GB. Each pipeline stage's source rank writes its adapters, under PEFT's names, as safetensors
into a directory every engine can read (sync.disk_dir, as the disk transport does); the driver
then makes that directory PEFT's adapter directory (one adapter_model.safetensors and
adapter_config.json, in place of the rank files) and every engine loads it through SGLang's `/load_lora_adapter` under the
version's name, and serves every later request (generation and the weights probe) with it; the
server's weight version is set to the version's (`/update_weight_version`: a LoRA load leaves it).
The adapter of the version before is unloaded once the new one is in. A restarted engine reloads the
newest adapter. Main entry points: `AdapterTransport`, `write_adapter_dir`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megarl.driver_loop import run_async
from megarl.weights.disk import DiskTransport, version_dir
from megarl.weights.routes import result
from megarl.weights.transport import needs_engine_servers

LOAD_ROUTE = "/load_lora_adapter"  # SGLang: LoadLoRAAdapterReqInput
UNLOAD_ROUTE = "/unload_lora_adapter"  # SGLang: UnloadLoRAAdapterReqInput
VERSION_ROUTE = "/update_weight_version"  # SGLang: UpdateWeightVersionReqInput
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's file names
ADAPTER_CONFIG = "adapter_config.json"


def adapter_name(version: int) -> str:
    """The name weight version `version`'s adapter is loaded and served under."""
    return f"megarl-v{version:06d}"


def load_body(name: str, directory: str) -> dict:
    """Load PEFT's adapter directory `directory` (on storage the server reads) as `name`."""
    return {"lora_name": name, "lora_path": str(directory)}


def unload_body(name: str) -> dict:
    return {"lora_name": name}


def version_body(version: int) -> dict:
    """The weight version the server reports in each answer (meta_info.weight_version, what
    megarl's staleness reads): a LoRA load leaves it as it was. Requests in flight are kept."""
    return {"new_version": str(version), "abort_all_requests": False}


def write_adapter_dir(directory: str | Path, lora, base_model: str) -> Path:
    """The rank files (`rank*.safetensors`, PEFT-named adapter tensors) in `directory` made into
    PEFT's adapter directory: one adapter_model.safetensors holding them all (the rank files are
    then removed) and adapter_config.json for `lora` (actor.lora) on `base_model`. A name in two
    files, or no adapter tensor at all, is an error."""
    from safetensors.torch import load_file, save_file

    from megarl.config_lora import peft_config

    directory = Path(directory)
    files = sorted(directory.glob("rank*.safetensors"))
    tensors: dict = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if name in tensors:
                raise ValueError(f"{file} holds {name}, which another rank's file holds too")
            tensors[name] = tensor
    if not any(".lora_A." in name for name in tensors):
        raise ValueError(f"no LoRA adapter tensors (PEFT names, '.lora_A.') in {directory}: the ranks sent "
                         f"{sorted(tensors)[:5]}")
    config = peft_config(lora)
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(directory))
    tmp = directory / (ADAPTER_WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.rename(directory / ADAPTER_WEIGHTS)
    for file in files:
        file.unlink()
    return directory


class AdapterTransport(DiskTransport):
    """The disk transport's senders and directory; the engines load an adapter, not weights."""

    name = "lora"
    request_structs = {LOAD_ROUTE: "LoadLoRAAdapterReqInput", UNLOAD_ROUTE: "UnloadLoRAAdapterReqInput",
                       VERSION_ROUTE: "UpdateWeightVersionReqInput"}

    @classmethod
    def check(cls, cfg: Any, problems: Any) -> None:
        needs_engine_servers(cls, cfg, problems)
        if not (cfg.actor.lora.enabled and cfg.actor.lora.sync == "adapter"):
            problems.add("sync.transport", "lora sends the LoRA adapters alone, and this run trains none "
                         "(actor.lora.r=0) or syncs them merged", "set actor.lora.r and actor.lora.sync=adapter")
        elif cfg.rollout.engine == "sglang" and cfg.rollout.sglang.server != "sglang":
            problems.add("actor.lora.sync", "adapter needs SGLang's own servers (LoRA serving); megarl's embedded "
                         "server serves merged weights", "use rollout.sglang.server=sglang or actor.lora.sync=merged")

    def finish(self, version: int) -> None:
        adapter = write_adapter_dir(version_dir(self.root, version), self.cfg.actor.lora, self.cfg.model.path)
        run_async(self.engines.load_adapter(str(adapter), version))

    @staticmethod
    def add_engine_routes(app: Any, engine: Any) -> None:
        @app.post(LOAD_ROUTE)
        async def load_lora_adapter():
            return result(False, "megarl's embedded engine serves merged weights, not LoRA adapters: use "
                                 "actor.lora.sync=merged")
