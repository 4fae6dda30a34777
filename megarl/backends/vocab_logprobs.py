"""Log-probs and entropy of target tokens from logits, a few tokens at a time.

At a 150k vocabulary the logits of a micro-batch are most of a step's memory: 4,096 tokens x
151,936 entries are 2.5 GB in float32, and the obvious `log_softmax(logits / T).gather(...)`
with an entropy beside it makes several more tensors of that size (the float copy, the scaled
logits, the log-softmax autograd keeps, the probabilities). `token_log_probs_from_logits`
makes none: it runs over the tokens in chunks of about CHUNK_ENTRIES entries, keeps per token
only what the backward needs (log Z, the entropy), and its backward recomputes each chunk's
probabilities and writes the gradient into the logits' own memory, which nothing else reads
after the loss (the LM head's backward needs its input and weight, not its output). So the
logits are the one (tokens x vocabulary) tensor of a micro-batch, forward and backward.

Both backends use it: the torch backend on full-vocabulary logits, the megatron backend on each
tensor-parallel rank's vocabulary slice (`group`: the reductions over the slices are all-reduces
in the forward; each rank's backward needs only its own slice and the replicated log Z).

For logits z (this rank's slice), temperature T, target y:
    m_r = max_v z_v / T on rank r, M = max_r m_r
    S = sum_r exp(m_r - M) sum_v exp(z_v / T - m_r),  log Z = M + log S
    log p(y) = z_y / T - log Z                   (z_y lives on exactly one rank)
    H = log Z - sum_v p_v z_v / T
    d log p(y) / d z_v = (1[v = y] - p_v) / T,  d H / d z_v = -p_v (z_v / T - log Z + H) / T
Entries at or beyond `vocab_size` (megatron's padding of the vocabulary) are left out.
Main entry point: `token_log_probs_from_logits`.
"""

from __future__ import annotations

import torch

# entries of one chunk's float32 temporaries (16 MB each; a chunk makes a few): the tokens a chunk
# takes are this over the vocabulary slice, at least one
CHUNK_ENTRIES = 1 << 22


def token_log_probs_from_logits(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                                with_entropy: bool = False, vocab_size: int | None = None, group=None,
                                chunk_tokens: int | None = None):
    """(log_probs, entropy or None), each shaped as `targets`, of `targets` under `logits`
    (..., V_local) / temperature. `vocab_size`: entries at or past it are padding; `group`: the
    tensor-parallel group whose ranks hold consecutive vocabulary slices (None: the whole
    vocabulary is here). Differentiable in both outputs; the backward overwrites `logits` with
    its gradient, so the caller must not read the logits after the backward."""
    width = logits.shape[-1]
    rank = torch.distributed.get_rank(group) if group is not None else 0
    start = rank * width
    chunk = chunk_tokens or max(1, CHUNK_ENTRIES // width)
    flat = logits.reshape(-1, width)
    lp, ent = _ChunkedLogProbs.apply(flat, targets.reshape(-1), float(temperature), vocab_size, start, group,
                                     with_entropy, chunk)
    return lp.view(targets.shape), (ent.view(targets.shape) if with_entropy else None)


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, vocab_size, start, group, with_entropy, chunk):
        n, width = logits.shape
        valid = _valid_columns(width, start, vocab_size, logits.device)
        mine = (targets >= start) & (targets < start + width)
        index = (targets - start).clamp(0, width - 1)
        local_max = torch.empty(n, device=logits.device)
        sums = torch.zeros(n, 3, device=logits.device)  # sum exp(z/T - m_r), sum exp(z/T - m_r) z/T, z_y/T
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = _scaled(logits[s:e], temperature, valid)
            m = z.amax(dim=-1)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a slice of padding only
            p = torch.exp(z - m[:, None])
            sums[s:e, 0] = p.sum(-1)
            if with_entropy:
                sums[s:e, 1] = (p * _real(z, valid)).sum(-1)
            sums[s:e, 2] = z.gather(-1, index[s:e, None])[:, 0].masked_fill(~mine[s:e], 0.0)
            local_max[s:e] = m
        if group is not None:
            top = local_max.clone()
            torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
            sums[:, :2] *= torch.exp(local_max - top)[:, None]
            torch.distributed.all_reduce(sums, group=group)
            local_max = top
        log_z = local_max + sums[:, 0].log()
        log_probs = sums[:, 2] - log_z
        entropy = log_z - sums[:, 1] / sums[:, 0] if with_entropy else torch.zeros_like(log_z)
        ctx.save_for_backward(logits, targets, log_z, entropy)
        ctx.settings = (temperature, vocab_size, start, chunk)
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, targets, log_z, entropy = ctx.saved_tensors
        temperature, vocab_size, start, chunk = ctx.settings
        n, width = logits.shape
        valid = _valid_columns(width, start, vocab_size, logits.device)
        mine = (targets >= start) & (targets < start + width)
        index = (targets - start).clamp(0, width - 1)
        grad = logits  # overwritten chunk by chunk: see the module docstring
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = _real(_scaled(logits[s:e], temperature, valid), valid)
            p = _real(torch.exp(z - log_z[s:e, None]), valid)
            g = torch.zeros_like(z)
            if grad_log_probs is not None:
                g -= p * grad_log_probs[s:e, None]
                g.scatter_add_(-1, index[s:e, None], (grad_log_probs[s:e] * mine[s:e])[:, None])
            if grad_entropy is not None:
                g -= p * (z - log_z[s:e, None] + entropy[s:e, None]) * grad_entropy[s:e, None]
            grad[s:e] = g / temperature
        return grad, None, None, None, None, None, None, None


def _valid_columns(width: int, start: int, vocab_size: int | None, device) -> torch.Tensor | None:
    """(width,) bool: which of this slice's entries are real vocabulary, not padding; None for all."""
    if vocab_size is None or start + width <= vocab_size:
        return None
    return torch.arange(start, start + width, device=device) < vocab_size


def _scaled(logits: torch.Tensor, temperature: float, valid: torch.Tensor | None) -> torch.Tensor:
    """A chunk's logits in float32 over the temperature, -inf at padding (not to be written to:
    at T = 1 in float32 it is the logits' own memory)."""
    z = logits.float()
    z = z / temperature if temperature != 1.0 else z
    return z if valid is None else z.masked_fill(~valid, float("-inf"))


def _real(t: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """`t` with 0 at the padding's entries."""
    return t if valid is None else t.masked_fill(~valid, 0.0)
