"""A frozen model whose weights live in host memory between uses (the reference model with
`actor.reference_offload`): each parameter and buffer keeps one host copy (pinned where CUDA
is, so the copy to the device is asynchronous), and the device holds them only inside
`on_device()`. Frozen means the host copy never goes stale, so nothing is copied back.
Main entry point: `HostOffloaded`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class HostOffloaded:
    def __init__(self, modules: list[torch.nn.Module], device: torch.device | str):
        self.device = torch.device(device)
        self.tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
        pin = torch.cuda.is_available()
        self.host = []
        for t in self.tensors:
            host = t.detach().to("cpu", copy=True)
            self.host.append(host.pin_memory() if pin else host)
            t.data = self.host[-1]  # the device copy is freed here

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """The weights on the device for the duration of the block, then back on the host."""
        try:
            for t, host in zip(self.tensors, self.host):
                t.data = host.to(self.device, non_blocking=True, copy=True)
            yield
        finally:
            for t, host in zip(self.tensors, self.host):
                t.data = host
