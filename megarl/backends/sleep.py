"""The trainer's device memory handed to the engines while they generate (colocated runs,
`trainer.sleep_during_generation`): weights and optimizer state copied into host buffers and
their device storage freed, gradients freed without a copy (every step zeroes them before its
first micro-batch), all of it back on the device, bit for bit, before the next training phase.

It works on storages, not tensors: every view of a storage (megatron's parameters and
gradients are views into its contiguous buffers, a tied embedding is one tensor under two
names) stays valid, since the storage object is resized in place and refilled. The host
buffers are pinned where CUDA is (so the copies are asynchronous) and are kept from one sleep
to the next, found again by size: the host holds one copy of the trainer's state, allocated
once. After a sleep the allocator's cache is emptied, so that the engines can take what was
freed. Main entry point: `TrainerSleep`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch


class TrainerSleep:
    """Moves the storages of the tensors it is given off `device` and back."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.pin = torch.cuda.is_available()
        self._free: dict[int, list[torch.Tensor]] = {}  # host buffers not holding anything, by size
        self._kept: list[tuple[torch.UntypedStorage, int, torch.Tensor]] = []  # (storage, bytes, host copy)
        self._dropped: list[tuple[torch.UntypedStorage, int]] = []
        self.asleep = False

    def sleep(self, keep: Iterable[torch.Tensor | None], drop: Iterable[torch.Tensor | None] = ()) -> float:
        """Free the device storage of `keep` (copied to the host first) and of `drop` (not
        copied: zeros when it comes back); the seconds it took."""
        if self.asleep:
            raise RuntimeError("the trainer is asleep already: wake() it first")
        start = time.perf_counter()
        kept = self._storages(keep, set())
        dropped = self._storages(drop, {s.data_ptr() for s in kept})
        for storage in kept:
            nbytes = storage.nbytes()
            host = self._host_buffer(nbytes)
            host.copy_(_bytes(storage, nbytes), non_blocking=self.pin)
            self._kept.append((storage, nbytes, host))
        self._synchronize()  # every copy done before its source is freed
        for storage, nbytes, _ in self._kept:
            storage.resize_(0)
        for storage in dropped:
            self._dropped.append((storage, storage.nbytes()))
            storage.resize_(0)
        self.asleep = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return time.perf_counter() - start

    def wake(self) -> float:
        """Every storage back on the device as it was (dropped ones zeroed); the seconds it took."""
        if not self.asleep:
            return 0.0
        start = time.perf_counter()
        for storage, nbytes, host in self._kept:
            storage.resize_(nbytes)
            _bytes(storage, nbytes).copy_(host, non_blocking=self.pin)
        for storage, nbytes in self._dropped:
            storage.resize_(nbytes)
            _bytes(storage, nbytes).zero_()
        self._synchronize()  # the host buffers are free again only once copied from
        for _, nbytes, host in self._kept:
            self._free.setdefault(nbytes, []).append(host)
        self._kept, self._dropped, self.asleep = [], [], False
        return time.perf_counter() - start

    @property
    def host_bytes(self) -> int:
        """Bytes of host buffers held (in use or kept for the next sleep)."""
        return (sum(n * len(b) for n, b in self._free.items()) + sum(n for _, n, _ in self._kept))

    def _storages(self, tensors: Iterable[torch.Tensor | None], seen: set[int]) -> list[torch.UntypedStorage]:
        """The distinct, non-empty storages on the device behind `tensors` (each once: views and
        tied weights share one), not those whose data pointers are in `seen`."""
        found = []
        for t in tensors:
            if t is None or t.device != self.device:
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                continue
            if not storage.resizable():  # a checkpoint's tensors mapped from their file: given memory of their own
                t.data = t.data.clone()
                storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                found.append(storage)
        return found

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _bytes(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """The storage's bytes as a uint8 tensor (a view: writing it writes the storage)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors an optimizer holds: its parameters (for megatron's distributed optimizer, the
    FP32 master shards) and every tensor of its state (Adam's moments and step). A torch
    optimizer, or megatron's (its torch optimizer inside; each of a chain's)."""
    tensors = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        tensors += [p for group in inner.param_groups for p in group["params"]]
        tensors += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def trained_tensors(modules: Iterable[torch.nn.Module], optimizers: Iterable,
                    frozen: Iterable[torch.nn.Module] = ()) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """(what a sleep keeps, what it drops) of trained `modules` with their `optimizers` and
    `frozen` ones: parameters, buffers and optimizer state kept; gradients dropped (`grad`, and
    megatron's `main_grad`, views into its gradient buffers)."""
    modules, frozen = list(modules), list(frozen)
    # nn.Module's own methods: megatron's DDP wrapper has an attribute `buffers` (its gradient buffers)
    keep = [t for m in modules + frozen for t in (*torch.nn.Module.parameters(m), *torch.nn.Module.buffers(m))]
    keep += [t for opt in optimizers for t in optimizer_tensors(opt)]
    drop = [g for m in modules for p in m.parameters() for g in (p.grad, getattr(p, "main_grad", None))]
    return keep, drop
