"""Reduce a per-token loss matrix (B, T) to the scalar that is back-propagated.

Main entry point: `agg_loss`. Gradient accumulation contract
-----------------------------------------------------------
A mini-batch (one optimizer step) is split into micro-batches and over data-parallel
(DP) ranks. Pass the GLOBAL counts of the whole mini-batch — `num_tokens` (valid tokens
over all micro-batches and all DP ranks) and `num_seqs` (sequences, likewise) — and every
mode becomes a plain sum of per-token or per-sequence terms over a constant denominator.
The micro-batch losses then SUM to the full mini-batch loss, so summing their gradients
(what `backward()` per micro-batch does) gives exactly the full-batch gradient, however
the batch is split and however unevenly the lengths fall.

* Do not divide by the number of micro-batches: the denominators already cover them.
* DP: the gradients of the ranks must be SUMMED. An all-reduce that AVERAGES (torch
  DDP, megatron's default) divides by the DP size, so multiply each rank's loss by the
  DP size to compensate.
* Defaults (counts taken from this call's mask) are right only when the call sees the
  whole mini-batch.
"""

from __future__ import annotations

import torch

from megarl.algo.masked import masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

Count = int | float | torch.Tensor


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    norm_length: Count | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss (B, T) into a scalar, L = loss_mat, m = mask.

    "token-mean"              Σ_{i,t} L·m / N_tok                       (DAPO token-level)
    "seq-mean-token-sum"      Σ_i Σ_t L·m / N_seq
    "seq-mean-token-mean"     Σ_i [Σ_t L·m / max(Σ_t m, 1)] / N_seq      (GRPO paper)
    "seq-mean-token-sum-norm" Σ_{i,t} L·m / (N_seq · norm_length)        (Dr.GRPO)

    N_tok = num_tokens (default: mask.sum() of this call), N_seq = num_seqs (default:
    B of this call), norm_length a constant (default T = mask.shape[-1]); pass the
    configured max response length so that micro-batches padded to different T agree.
    For gradient accumulation pass the global counts of the mini-batch (module docstring).
    A count of 0 is treated as 1 so an all-padding batch gives 0, not NaN.
    Shapes: loss_mat, mask (B, T) → scalar tensor, units of L.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
    batch_size = mask.shape[0]
    if mode == "token-mean":
        total_tokens = mask.bool().sum() if num_tokens is None else num_tokens
        return masked_sum(loss_mat, mask) / _at_least_one(total_tokens)
    total_seqs = _at_least_one(batch_size if num_seqs is None else num_seqs)
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, mask) / total_seqs
    if mode == "seq-mean-token-mean":
        seq_lengths = mask.bool().sum(-1).clamp_min(1)
        return (masked_sum(loss_mat, mask, dim=-1) / seq_lengths).sum() / total_seqs
    length = mask.shape[-1] if norm_length is None else norm_length
    return masked_sum(loss_mat, mask) / (total_seqs * _at_least_one(length))


def _at_least_one(count: Count) -> Count:
    if isinstance(count, torch.Tensor):
        return count.clamp_min(1)
    return max(count, 1)
