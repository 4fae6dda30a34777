"""The trainer's device memory handed to the engines while they generate (colocated runs,
`trainer.sleep_during_generation`): weights and optimizer state copied into host buffers and
their device storage freed, gradients freed without a copy (every step zeroes them before its
first micro-batch), all of it back on the device, bit for bit, before the next training phase.

It works on storages, not tensors: every view of a storage (megatron's parameters and
gradients are views into its contiguous buffers, a tied embedding is one tensor under two
names) stays valid, since the storage object is resized in place and refilled. The host copies
are slices of one pool, allocated at the first sleep (again only when a later sleep needs more,
as when Adam's state appears at the first step) and kept: the host holds one copy of the
trainer's state. Where CUDA is, the pool is page-locked with cudaHostRegister, so the copies are
asynchronous: torch's pinned allocator (`pin_memory=True`) rounds every block up to a power of
two, up to twice the bytes held when each tensor had a block of its own. After a sleep the
allocator's cache is emptied, so that the engines can take what was freed. Main entry point:
`TrainerSleep`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

POOL_ALIGN = 512  # bytes: each storage's slice of the pool starts at a multiple (what CUDA's copies like best)


def cuda_host_register(pool: torch.Tensor) -> Callable[[], None]:
    """Page-lock `pool`'s memory as it is (no rounding); the function that unlocks it."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = pool.data_ptr(), pool.numel()
    status = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister of the trainer's {nbytes / 2**30:.1f} GiB sleep pool failed ({status})")
    return lambda: cudart.cudaHostUnregister(ptr)


class TrainerSleep:
    """Moves the storages of the tensors it is given off `device` and back. `pin`: page-lock the
    host pool (default: where CUDA is) with `register` (cuda_host_register by default)."""

    def __init__(self, device: torch.device | str, pin: bool | None = None,
                 register: Callable[[torch.Tensor], Callable[[], None]] = cuda_host_register):
        self.device = torch.device(device)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._register = register
        self._pool: torch.Tensor | None = None  # the host copies' memory, one block
        self._unpin: Callable[[], None] | None = None
        self._kept: list[tuple[torch.UntypedStorage, int, torch.Tensor]] = []  # (storage, bytes, host copy)
        self._dropped: list[tuple[torch.UntypedStorage, int]] = []
        self.asleep = False

    def sleep(self, keep: Iterable[torch.Tensor | None], drop: Iterable[torch.Tensor | None] = (),
              spare: Iterable[torch.Tensor | None] = ()) -> float:
        """Free the device storage of `keep` (copied to the host first) and of `drop` (not
        copied: zeros when it comes back), but not the storages of `spare`; the seconds it took."""
        if self.asleep:
            raise RuntimeError("the trainer is asleep already: wake() it first")
        start = time.perf_counter()
        kept = self._storages(keep, {s.data_ptr() for s in self._storages(spare, set())})
        dropped = self._storages(drop, {s.data_ptr() for s in kept})
        offsets, total = [], 0
        for storage in kept:
            offsets.append(total)
            total += -(-storage.nbytes() // POOL_ALIGN) * POOL_ALIGN
        pool = self._pool_of(total)
        for storage, offset in zip(kept, offsets):
            nbytes = storage.nbytes()
            host = pool[offset: offset + nbytes]
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
        self._synchronize()  # the pool is free again only once copied from
        self._kept, self._dropped, self.asleep = [], [], False
        return time.perf_counter() - start

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory held for the copies (the pool, in use or kept for the next sleep)."""
        return 0 if self._pool is None else self._pool.numel()

    def _pool_of(self, nbytes: int) -> torch.Tensor:
        """The pool, made (or made anew, larger) to hold `nbytes`."""
        if self._pool is not None and self._pool.numel() >= nbytes:
            return self._pool
        self.release_pool()
        pool = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin and nbytes:
            self._unpin = self._register(pool)
        self._pool = pool
        return pool

    def release_pool(self) -> None:
        """Give the host pool back (awake only)."""
        if self.asleep:
            raise RuntimeError("the trainer is asleep: its state is in the pool")
        if self._unpin is not None:
            self._unpin()
        self._pool = self._unpin = None

    def _storages(self, tensors: Iterable[torch.Tensor | None], seen: set[int]) -> list[torch.UntypedStorage]:
        """The distinct, non-empty storages on the device behind `tensors` (each once: views and
        tied weights share one; a wrapper tensor's inner buffers: `held_tensors`), not those whose
        data pointers are in `seen`."""
        found = []
        for t in (held for t in tensors if t is not None for held in held_tensors(t)):
            if t.device != self.device:
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

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# Where Transformer Engine's quantized tensors keep their bytes (the FP8 parameters of
# fp8_param_gather, the FP8 weight workspaces): wrapper tensors whose inner buffers hold them. The
# wrapper's own storage is no guide: TE < 2.16 leaves torch's (its data pointer raises), 2.9-2.15's
# Float8BlockwiseQTensor answers its rowwise data's alone (the scales and columnwise copy left
# out), TE >= 2.16 an empty one (a sleep going by it would skip the FP8 weights). The same names
# from TE 2.8 to 2.20: Float8Tensor, MXFP8Tensor, Float8BlockwiseQTensor, NVFP4Tensor; 2.19's
# HybridQuantizedTensor nests two of them (_rowwise_storage, _columnwise_storage), its
# IdentityTensor holds _hp_data.
QUANTIZED_BUFFERS = ("_data", "_transpose", "_scale_inv", "_rowwise_data", "_columnwise_data", "_rowwise_scale_inv",
                     "_columnwise_scale_inv", "_amax_rowwise", "_amax_columnwise", "_rowwise_storage",
                     "_columnwise_storage", "_hp_data")
# TE >= 2.14's GroupedTensor (the experts' one weight of GroupedLinear with single_grouped_weight,
# megatron's moe_single_grouped_weight): names without the underscore, torch's own wrapper storage
GROUPED_BUFFERS = ("rowwise_data", "columnwise_data", "scale_inv", "columnwise_scale_inv", "amax", "columnwise_amax",
                   "scale", "first_dims", "last_dims", "tensor_offsets")
GROUPED_CLASSES = {"GroupedTensor", "GroupedTensorStorage"}


def held_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `t`'s bytes: `t` itself, or a wrapper's inner buffers
    (QUANTIZED_BUFFERS; GROUPED_BUFFERS for a GroupedTensor), each nested wrapper opened too."""
    names = QUANTIZED_BUFFERS
    if any(c.__name__ in GROUPED_CLASSES for c in type(t).__mro__):
        names = GROUPED_BUFFERS
    inner = [x for x in (getattr(t, name, None) for name in names) if isinstance(x, torch.Tensor)]
    if not inner:
        return [t]
    return [held for x in inner for held in held_tensors(x)]


def free_fp8_workspaces(modules: Iterable[torch.nn.Module]) -> int:
    """Drop Transformer Engine's cached FP8 copies (and transposes) of the weights: about 2 bytes a
    parameter that a sleeping trainer would leave on the GPU. They are caches: TE makes a missing
    one again from the weight at its next forward. The bytes dropped."""
    freed = 0
    for module in modules:
        for sub in module.modules():
            workspaces = getattr(sub, "_fp8_workspaces", None)
            if isinstance(workspaces, dict) and workspaces:
                freed += sum(x.numel() * x.element_size() for w in workspaces.values()
                             if isinstance(w, torch.Tensor) for x in held_tensors(w))
                workspaces.clear()
    return freed


def _bytes(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """The storage's bytes as a uint8 tensor (a view: writing it writes the storage)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


class WorkerSleep:
    """A train worker's sleep in two parts: its state (optimizer state, gradients, the frozen
    reference, TE's FP8 weight caches), which can go first, and its weights, which a colocated
    sync still reads (megarl.runtime.base.Runtime.sync_weights: the engines' weights come back
    with only the trainer's weights left on the GPU, as verl frees all but the weights there)."""

    def __init__(self, device: torch.device | str, **pool):
        self.state, self.weights = TrainerSleep(device, **pool), TrainerSleep(device, **pool)

    def sleep(self, modules: list[torch.nn.Module], optimizers: list, frozen: list[torch.nn.Module] = (),
              keep_weights: bool = False) -> float:
        """TE's FP8 weight caches dropped (at every call), the state off the device (unless it is
        already), then, unless `keep_weights`, the weights (parameters and buffers of `modules`);
        the seconds it took."""
        seconds = 0.0
        weights = [t for m in modules for t in (*torch.nn.Module.parameters(m), *torch.nn.Module.buffers(m))]
        # every sleep, not only the state's: a forward while the state sleeps (the weights probe's,
        # in a colocated sync) builds the caches again, and the engines generate after this one
        free_fp8_workspaces([*modules, *frozen])
        if not self.state.asleep:
            keep, drop = trained_tensors(modules, optimizers, frozen)
            seconds += self.state.sleep(keep, drop, spare=weights)
        if not keep_weights and not self.weights.asleep:
            seconds += self.weights.sleep(weights)
        return seconds

    def wake(self, weights_only: bool = False) -> float:
        """The weights back on the device, and the state too unless `weights_only`; the seconds."""
        return self.weights.wake() + (0.0 if weights_only else self.state.wake())

    @property
    def host_bytes(self) -> int:
        return self.state.host_bytes + self.weights.host_bytes


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
