"""Per-token log-probs and entropy of a causal LM over a `TrainBatch`-shaped row block.

Log-probs follow the rollout engines' convention (megarl.rollout.engine): log softmax of
logits / T, T the sampling temperature, so trainer and engine compare like with like.
Main entry point: `token_log_probs`.
"""

from __future__ import annotations

import functools
import inspect

import torch

from megarl.backends.vocab_logprobs import token_log_probs_from_logits
from megarl.backends.torch.shared_prompts import prompt_plan, shared_prompt_logits


def token_log_probs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    temperature: float = 1.0, with_entropy: bool = False, router_logits: list | None = None,
                    wanted: torch.Tensor | None = None, entropy_grad: bool = False, share_prompts: bool = False):
    """(log_probs, entropy or None), each (B, L): entry t is for token t given tokens < t;
    entry 0 (no context) is 0. Right padding is harmless: causal attention never lets a
    real token see the padding after it. A mixture of experts appends each MoE layer's router
    logits (B * L, experts) to `router_logits` when one is given.

    `wanted` (B, L), e.g. the loss mask: only these entries are needed. The LM head and the
    softmax then run from the first wanted column on (the prompts' columns before it are 0),
    as TRL's `logits_to_keep` does; at a 150k vocabulary the logits are most of a step's
    activations. The entropy is a metric and carries no gradient unless `entropy_grad`
    (an entropy bonus in the loss).

    `share_prompts` (with `wanted`, and no router logits): rows that start with the same prompt
    have it forwarded once (megarl.backends.torch.shared_prompts), when that saves enough tokens;
    a row's entries before its first wanted column are then 0."""
    if share_prompts and wanted is not None and router_logits is None and not _checkpointed(model):
        plan = prompt_plan(input_ids, attention_mask, wanted)
        if plan is not None:
            shared = _shared(model, input_ids, plan, temperature, with_entropy, entropy_grad)
            if shared is not None:
                return shared
    first = _first_column(wanted) if _keeps_logits(model) else 1
    kw = {"output_router_logits": True} if router_logits is not None else {}
    if first > 1:
        kw["logits_to_keep"] = input_ids.shape[1] - first + 1
    out = model(input_ids=input_ids, attention_mask=attention_mask, **kw)
    if router_logits is not None:
        router_logits.extend(out.router_logits or ())
    # column j: the next token's logits after column first - 1 + j; the last column's logits
    # predict no token of the row (scored against a stand-in, dropped): the logits are scored as
    # they are, without a copy of all but their last column
    stand_in = torch.zeros_like(input_ids[:, :1])
    log_probs, entropy = _scored(out.logits, torch.cat([input_ids[:, first:], stand_in], dim=1), temperature,
                                 with_entropy, entropy_grad)
    log_probs, entropy = log_probs[:, :-1], (entropy[:, :-1] if with_entropy else None)
    skipped = torch.zeros_like(log_probs[:, :1]).expand(-1, first)
    log_probs = torch.cat([skipped, log_probs], dim=1)
    return log_probs, (torch.cat([skipped, entropy], dim=1) if with_entropy else None)


def _scored(logits, tokens, temperature, with_entropy, entropy_grad):
    """(log-probs of `tokens` under `logits` / T, entropy or None): both forwards' last step,
    a few tokens at a time (megarl.backends.vocab_logprobs: no other tensor of the logits' size;
    their memory takes the gradient in the backward)."""
    log_probs, entropy = token_log_probs_from_logits(logits, tokens, temperature=temperature,
                                                     with_entropy=with_entropy)
    if with_entropy and not entropy_grad:
        entropy = entropy.detach()
    return log_probs, entropy


def _shared(model, input_ids, plan, temperature, with_entropy, entropy_grad):
    """token_log_probs's (log_probs, entropy) with each bucket's prompts forwarded once; None
    when the model offers no cache to share (the caller then takes the plain forward)."""
    log_probs = torch.zeros(input_ids.shape, device=input_ids.device)
    entropy = torch.zeros(input_ids.shape, device=input_ids.device) if with_entropy else None
    for bucket in plan:
        logits = shared_prompt_logits(model, input_ids, bucket)
        if logits is None:
            return None
        rows = bucket.rows.to(input_ids.device)[:, None]
        columns = torch.arange(bucket.length, bucket.length + bucket.width, device=input_ids.device)[None, :]
        scored, scored_entropy = _scored(logits, input_ids[rows, columns], temperature, with_entropy, entropy_grad)
        log_probs = log_probs.index_put((rows, columns), scored)
        if with_entropy:
            entropy = entropy.index_put((rows, columns), scored_entropy)
    return log_probs, entropy


def _checkpointed(model: torch.nn.Module) -> bool:
    """Gradient checkpointing is on (HF marks the layers it recomputes): HF then turns the cache off
    in training, so nothing is shared."""
    return model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _first_column(wanted: torch.Tensor | None) -> int:
    """The first column (at least 1) any row wants, or 1 when `wanted` is None or empty."""
    if wanted is None:
        return 1
    columns = wanted.any(dim=0).nonzero()
    return max(1, int(columns[0])) if len(columns) else 1


def _keeps_logits(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes HF's `logits_to_keep` (current causal LMs do; a PEFT model
    passes it on to the HF model inside)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _class_keeps_logits(type(inner))


@functools.cache
def _class_keeps_logits(cls: type) -> bool:  # asked once per model class, not at every forward
    try:
        return "logits_to_keep" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
