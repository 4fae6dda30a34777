"""Trainer weights to rollout engines: buckets (megarl.weights.buckets) and the weight
transports that move them, each one module implementing megarl.weights.transport's
interface (driver side, rank side, engine side, config rules).

`TRANSPORTS` is the registry: sync.transport's value -> "module:class". Adding a transport
is one new module plus one line here. Modules are imported when used, so reading a config
stays cheap. Main entry points: `TRANSPORTS`, `transport_class`, `all_transports`.
"""

from __future__ import annotations

import importlib

TRANSPORTS = {
    "inprocess": "megarl.weights.inprocess:InProcessTransport",
    "disk": "megarl.weights.disk:DiskTransport",
    "nccl": "megarl.weights.group:GroupTransport",
    "ipc": "megarl.weights.ipc:IpcTransport",
    "lora": "megarl.weights.adapters:AdapterTransport",
}


def transport_class(name: str):
    """The WeightTransport subclass registered as `name`; ValueError listing the names."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {name!r}; known: {sorted(TRANSPORTS)}")
    module, _, cls = TRANSPORTS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def all_transports() -> list:
    return [transport_class(name) for name in TRANSPORTS]
