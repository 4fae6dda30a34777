"""Samples that share a prompt, forwarded with the prompt once (actor.share_prompts).

GRPO-style groups put G samples of each prompt in a batch, and a mini-batch holds several samples
of most of its prompts. A row's log-probs depend on its prompt only through the prompt's keys and
values in each layer, so each distinct prompt of a micro-batch is forwarded once, its key/value
cache handed to every row that starts with it, and the rows' responses forwarded on that cache.
The log-probs, the entropy and, through the cache, the gradients are the plain forward's up to
float rounding; the tokens forwarded go from rows x width to prompts x prompt length + rows x
response length (on the math quickstart: 5,568 to about 2,500 a mini-batch).

Only standard HF calls are made (`logits_to_keep`, the model's cache), so every attention
implementation serves it: prompts are forwarded in buckets of one length (no padding inside a
prompt, so every position is its own cache slot), and a response's padding is at its end, where
causal attention keeps the real tokens from it without a mask. A model with no cache to
select from (or MoE routing to record or replay: the caller's business) takes the plain forward.
Main entry points: `prompt_plan`, `shared_prompt_logits`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

# share only when it forwards at most this share of the plain forward's tokens (each bucket of
# prompts is two forward calls instead of one: a small saving is not worth the calls)
WORTH_SHARING = 0.75


@dataclass(frozen=True)
class PromptBucket:
    """Prompts of one length and the rows that start with them."""
    length: int  # tokens of each prompt: the rows' response starts at this column
    prompts: torch.Tensor  # (U, length) the distinct prompts
    rows: torch.Tensor  # (B_b,) the rows of the batch that start with one of them
    prompt_of_row: torch.Tensor  # (B_b,) which prompt each of those rows starts with
    width: int  # the longest response among those rows


def prompt_plan(input_ids: torch.Tensor, attention_mask: torch.Tensor, wanted: torch.Tensor
                ) -> list[PromptBucket] | None:
    """The buckets of distinct prompts of a right-padded row block, or None when sharing would not
    pay (WORTH_SHARING). A row's prompt is everything before its first wanted column (the first
    sampled token); a row with no wanted column needs no log-prob and is left out (its entries
    stay 0)."""
    wants = wanted.bool()
    has = wants.any(dim=1)
    starts = wants.int().argmax(dim=1).clamp(min=1).tolist()  # read only for rows that want a column
    lengths = attention_mask.sum(dim=1).tolist()
    ids = input_ids.tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for row in has.nonzero().flatten().tolist():
        groups.setdefault(tuple(ids[row][:starts[row]]), []).append(row)
    by_length: dict[int, list[tuple[int, ...]]] = {}
    for prompt in groups:
        by_length.setdefault(len(prompt), []).append(prompt)
    buckets, tokens = [], 0
    for length, prompts in sorted(by_length.items()):
        rows = [row for p in prompts for row in groups[p]]
        which = [i for i, p in enumerate(prompts) for _ in groups[p]]
        width = max(lengths[row] - length for row in rows)
        tokens += len(prompts) * length + len(rows) * width
        buckets.append(PromptBucket(length, torch.tensor(prompts), torch.tensor(rows),
                                    torch.tensor(which), width))
    if not buckets or tokens > WORTH_SHARING * input_ids.numel():
        return None
    return buckets


def shared_prompt_logits(model: torch.nn.Module, input_ids: torch.Tensor, bucket: PromptBucket) -> torch.Tensor | None:
    """(B_b, width, V): for each of the bucket's rows, the logits that predict its tokens at
    columns length .. length + width - 1 (the first from the prompt's last position, the rest
    from the response's); None when the model's forward offers no cache to share."""
    names = cache_names(model)
    if names is None:
        return None
    argument, attribute = names
    device = input_ids.device
    prompts = bucket.prompts.to(device)
    first = model(input_ids=prompts, use_cache=True, logits_to_keep=1)  # no padding: no mask
    cache = getattr(first, attribute)
    if not hasattr(cache, "batch_select_indices"):
        return None
    which, rows = bucket.prompt_of_row.to(device), bucket.rows.to(device)
    cache.batch_select_indices(which)  # each row's copy of its prompt's keys and values (gradients flow back)
    # the responses' padding is at their ends, where causal attention keeps every real token from it: no mask
    responses = input_ids[rows, bucket.length:bucket.length + bucket.width]
    rest = model(input_ids=responses, **{argument: cache})
    return torch.cat([first.logits[which, -1:], rest.logits[:, :-1]], dim=1)


def cache_names(model: torch.nn.Module) -> tuple[str, str] | None:
    """(the forward's cache argument, its output's cache attribute): ("cache", "cache") in
    transformers 5.2x, ("past_key_values", "past_key_values") before; None when neither (or the
    forward takes no `logits_to_keep`). Read from the signature on each call: microseconds beside
    a forward, and nothing cached for a test to leak into the next."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        params = inspect.signature(type(inner).forward).parameters
    except (TypeError, ValueError):
        return None
    if "logits_to_keep" not in params:
        return None
    for name in ("cache", "past_key_values"):
        if name in params:
            return name, name
    return None
