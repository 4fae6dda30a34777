"""Test/CPU support stand-in for the ``sgl_kernel`` package (not the real one).

SGLang 0.5.23's CPU engine (``SGLANG_USE_CPU_ENGINE=1 ... --device cpu``) imports two helpers
from ``sgl_kernel`` at module level, whose wheels on PyPI (``sgl-kernel`` / ``sglang-kernel``)
are CUDA-only and do not load on a CPU-only torch. This package replaces exactly those two
helpers with plain torch code, so the CPU engine runs on a machine without the wheels:

- ``assign_req_to_token_pool_cpu`` (``sglang/srt/mem_cache/allocation.py``), the CPU twin of
  the triton kernel ``assign_req_to_token_pool`` in the same file;
- ``copy_all_layer_kv_cache_cpu`` (``sglang/kernels/ops/kvcache/cache_move.py``), the CPU twin
  of the triton kernel ``copy_all_layer_kv_cache_tiled`` there.

SGLang calls them only for speculative decoding and KV-cache row moves: plain serving only
imports them, so tools/sglang_cpu/smoke.py checks both against the triton kernels' semantics.

SGLang also imports, at module level on the CPU path, the CPU helpers of speculative decoding
(EAGLE / tree verification, listed in ``_SPECULATIVE_CPU_HELPERS``); they are not called unless
speculative decoding is turned on, so here they are names that raise ``NotImplementedError``.
Nothing else of ``sgl_kernel`` is provided. In particular ``torch.ops.sgl_kernel`` stays empty,
so SGLang's Intel AMX backend (which checks for ``torch.ops.sgl_kernel.convert_weight_packed``)
stays off and the engine uses its torch-native CPU paths. Installed into ``.venv-sglang`` by
``make sglang-env`` through a ``.pth`` file; never used by megarl itself.
"""

import ctypes

import torch

__version__ = "0.0.0+megarl.cpu.standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write the new KV-cache slots of each request into its row of the request-to-token map.

    For request i: ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` gets the
    i-th slice of ``out_cache_loc``, whose slices follow each other in request order (the slice of
    request i starts at ``sum(end_offset[:i] - start_offset[:i])``). ``pool_len`` is the row
    length of ``req_to_token`` (the triton kernel's pointer arithmetic needs it; indexing does not).
    """
    lens = (end_offset - start_offset).long()
    total = int(lens.sum())
    if total == 0:
        return
    rows = req_pool_indices.long().repeat_interleave(lens)
    # column of each written token: its request's start_offset + its position within the slice
    slice_begin = torch.cumsum(lens, 0) - lens
    cols = torch.arange(total) - slice_begin.repeat_interleave(lens)
    cols += start_offset.long().repeat_interleave(lens)
    req_to_token[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Move KV-cache rows ``src_loc`` to rows ``tgt_loc`` in every buffer of every layer.

    Buffer b starts at the raw address ``data_ptrs[b]`` and its rows are ``strides[b]`` bytes
    apart, each row being ``strides[b]`` bytes of data (SGLang passes ``stride(0) * itemsize`` of
    contiguous buffers). All source rows are read before any target row is written, so the copy is
    safe when the two sets of rows overlap, as in the triton kernel.
    """
    if src_loc.numel() == 0:
        return
    src = src_loc.long()
    tgt = tgt_loc.long()
    num_rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for ptr, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        # a zero-copy uint8 view of the first num_rows rows of the buffer
        raw = (ctypes.c_uint8 * (num_rows * row_bytes)).from_address(ptr)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, row_bytes)
        rows[tgt] = rows[src]


def _not_provided(name: str):
    def helper(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: not provided by the CPU stand-in (tools/sglang_cpu/sgl_kernel); "
            "speculative decoding is not supported on SGLang's CPU engine here"
        )

    helper.__name__ = helper.__qualname__ = name
    return helper


# imported at module level by sglang/kernels/ops/speculative/*.py when the CPU engine is on
_SPECULATIVE_CPU_HELPERS = (
    "assign_draft_cache_locs_contiguous_cpu",  # cache_locs.py
    "assign_extend_cache_locs_cpu",  # cache_locs.py
    "build_tree_kernel_efficient_cpu",  # spec_tree.py
    "verify_tree_greedy_cpu",  # spec_tree.py
    "fill_accept_out_cache_loc_cpu",  # eagle.py
    "fill_bonus_tokens_cpu",  # eagle.py
    "rotate_input_ids_cpu",  # multi_layer_eagle.py
)
globals().update({name: _not_provided(name) for name in _SPECULATIVE_CPU_HELPERS})
