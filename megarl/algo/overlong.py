"""DAPO soft overlong punishment: a length penalty added to the reward of responses that
run into the last `buffer_len` tokens before `max_response_length`.

Main entry point: `overlong_penalty`.
"""

from __future__ import annotations

import torch


def overlong_penalty(
    length: int | float | torch.Tensor, max_response_length: int, buffer_len: int, penalty_factor: float = 1.0
) -> float | torch.Tensor:
    """Penalty in reward units, ≤ 0, added to the task reward.

    penalty = min(−(L − (L_max − buffer)) / buffer × factor, 0)
    0 up to L_max − buffer tokens, then linear down to −factor at L = L_max (and further
    below beyond it). length L in tokens: a number (returns float) or a tensor (elementwise,
    float tensor). DAPO: L_max = 20480, buffer = 4096, factor 1.0.
    """
    if buffer_len <= 0:
        raise ValueError(f"buffer_len={buffer_len} must be > 0 (algorithm.overlong.buffer_len)")
    if buffer_len >= max_response_length:
        raise ValueError(
            f"buffer_len={buffer_len} must be below max_response_length={max_response_length}: "
            "the punishment zone is the last buffer_len tokens of the allowed length"
        )
    penalty_start = max_response_length - buffer_len
    if isinstance(length, torch.Tensor):
        excess = length.to(torch.promote_types(length.dtype, torch.float32)) - penalty_start
        return (-excess / buffer_len * penalty_factor).clamp_max(0.0)
    return min(-(length - penalty_start) / buffer_len * penalty_factor, 0.0)
