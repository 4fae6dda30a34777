"""Run megatron-core on a CPU-only machine (gloo, fp32, tiny models): for tests and CI.

megatron-core assumes CUDA in a few places that have nothing to do with the numerics:
the device of the current rank, the CUDA RNG state its RNG tracker forks, `synchronize`, the
streams and events the MoE all-to-all dispatcher overlaps its host copies with,
and factory calls that pass `device="cuda"` or `pin_memory=True` (the pipeline schedules'
buffers, the default causal mask, rotary frequencies), and type checks that compare `tensor.type()` with
"torch.cuda.FloatTensor" (the optimizers). `enable_cpu_mode()` redirects exactly those to the CPU
and leaves everything else alone. It does nothing when CUDA is available, so the same code
runs unchanged on GPUs. Call it before building models (the backend does).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from megarl.compat import name_te_general_gemm

_lock = threading.Lock()
_enabled = False


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


# warnings that only say the CPU build lacks GPU libraries, or that megatron and torch
# deprecated something megarl does not call itself; each rank would print them all
_KNOWN_WARNINGS = ("Apex is not installed", "Transformer Engine and Apex are not installed",
                   "full scope is deprecated", "CUDA_DEVICE_MAX_CONNECTIONS", "is deprecated. Please use",
                   "The .grad attribute of a Tensor that is not a leaf")


def silence_known_warnings() -> None:
    import warnings

    for text in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{text}")


def enable_cpu_mode() -> bool:
    """Redirect megatron-core's CUDA-only calls to the CPU when CUDA is absent; True if it did.
    Idempotent and process-wide."""
    global _enabled
    if not cuda_absent():
        return False
    with _lock:
        if _enabled:
            return True
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda device=None: None
        torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
        torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
        # the CPU generator itself: torch.manual_seed calls torch.cuda.manual_seed_all
        torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
        torch.cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))

        from megatron.core.tensor_parallel import random as mp_random

        mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
        mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
        # the causal mask is also built inside recomputation's backward pass, where the
        # function mode below is not active: redirect the function itself
        from megatron.core.fusions import fused_softmax
        from megatron.core.transformer import utils as transformer_utils

        def causal_mask(sq: int) -> torch.Tensor:
            return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

        transformer_utils.get_default_causal_mask = causal_mask
        if hasattr(fused_softmax, "get_default_causal_mask"):
            fused_softmax.get_default_causal_mask = causal_mask
        from megatron.core.transformer.moe import moe_utils

        name_te_general_gemm(moe_utils)  # megatron-core 0.16's router without TE (megarl.compat)
        # the all-to-all token dispatcher copies its split sizes to the host on a side stream
        # and waits on an event; on the CPU every copy is already done
        torch.cuda.Stream = _HostStream
        torch.cuda.current_stream = lambda device=None: _HOST_STREAM
        torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
        # ... and passes them to all_to_all as the numpy arrays that copy makes of GPU tensors
        from megatron.core.transformer.moe import token_dispatcher

        def to_host(tensor, as_numpy=False, record_stream=False):
            return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

        moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = to_host
        _CudaToCpu().__enter__()  # for the life of the process
        _enabled = True
    return True


class _HostEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _HostStream:
    """A CUDA stream's stand-in on the CPU: work is done when it is issued."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _HostEvent:
        return event or _HostEvent()

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpu(TorchFunctionMode):
    """Rewrites device="cuda" in factory calls and `.cuda()` / `.to("cuda")` to the CPU, and
    answers `tensor.type()` with the CUDA type name megatron's optimizers check for."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # pinned memory needs an accelerator (rotary embeddings under CP)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if func is torch.Tensor.to and args[1:] and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)
