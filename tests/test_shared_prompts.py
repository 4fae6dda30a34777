"""actor.share_prompts: each distinct prompt of a micro-batch forwarded once, its keys and values
shared by the rows that start with it. Checked against each row's own plain forward pass (the
slow reference): log-probs, entropy and the gradient of the loss, for the families megarl trains,
and the cases that must not share."""

from __future__ import annotations

import pytest
import torch

from megarl.backends.batch import TrainBatch
from megarl.backends.torch.actor import TorchActor
from megarl.backends.torch.logprobs import token_log_probs
from megarl.backends.torch.shared_prompts import cache_names, prompt_plan
from megarl.config import AlgorithmConfig, OptimConfig
from tiny_models import tiny_model

A, B, C = [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16, 17, 18]


def group_batch():
    """Rows of three prompts (two of one length), G = 3, responses of 1-5 tokens, one masked
    token inside a response (a tool's output), right-padded."""
    torch.manual_seed(3)
    prompts, responses, masks = [], [], []
    for prompt in (A, B, C):
        for _ in range(3):
            n = int(torch.randint(1, 6, ()))
            prompts.append(prompt)
            responses.append(torch.randint(20, 290, (n,)).tolist())
            masks.append([1] * n)
    masks[1] = [1] + [0] * (len(masks[1]) - 1) if len(masks[1]) > 1 else masks[1]
    return prompts, responses, TrainBatch.from_sequences(prompts, responses, masks)


def forward_calls(model):
    calls = []
    handle = model.register_forward_hook(lambda mod, args, kwargs, out: calls.append(kwargs["input_ids"].shape),
                                         with_kwargs=True)
    return calls, handle


def test_the_plan_groups_rows_by_prompt_and_prompts_by_length():
    ids = torch.tensor([[1, 2, 7, 8, 0], [1, 2, 9, 0, 0], [3, 4, 5, 6, 6], [1, 2, 7, 0, 0], [3, 4, 5, 1, 1],
                        [4, 4, 4, 4, 4]])
    attention = (ids > 0).long()
    attention[[2, 4, 5]] = 1  # rows 2 and 4 are whole; row 5 wants nothing
    wanted = torch.zeros_like(ids)
    wanted[0, 2:4] = wanted[1, 2] = wanted[3, 2] = 1
    wanted[2, 3:] = wanted[4, 3:] = 1
    plan = prompt_plan(ids, attention, wanted)
    assert [(b.length, b.prompts.tolist(), b.rows.tolist(), b.prompt_of_row.tolist(), b.width) for b in plan] == [
        (2, [[1, 2]], [0, 1, 3], [0, 0, 0], 2),
        (3, [[3, 4, 5]], [2, 4], [0, 0], 2),
    ]


def test_a_one_token_prompt_is_its_first_column():
    """The weights probe's rows: a prompt of one token, the token after it wanted."""
    ids = torch.tensor([[4, 7], [4, 9], [4, 8], [4, 7]])
    plan = prompt_plan(ids, torch.ones_like(ids), torch.tensor([[0, 1]] * 4))
    assert [(b.length, b.prompts.tolist(), b.rows.tolist(), b.width) for b in plan] == [(1, [[4]], [0, 1, 2, 3], 1)]


def wanted_from(ids: torch.Tensor, column: int) -> torch.Tensor:
    return (torch.arange(ids.shape[1]) >= column).long().expand_as(ids)


@pytest.mark.parametrize("prompt, shares", [(4, True), (3, False)])
def test_sharing_is_planned_up_to_three_quarters_of_the_plain_tokens(prompt, shares):
    """2 rows x 8 columns: 16 plain tokens, 12 at most shared. A prompt of 4 tokens: 4 + 2 rows x
    4 response tokens = 12, shared; of 3: 3 + 2 x 5 = 13, not."""
    ids = torch.tensor([list(range(1, prompt + 1)) + [9] * (8 - prompt)] * 2)
    assert (prompt_plan(ids, torch.ones_like(ids), wanted_from(ids, prompt)) is not None) == shares


def test_the_tokens_of_every_bucket_count():
    """Rows 0-1: the prompt [1] (responses of 3): 1 + 2 x 3 = 7 tokens; rows 2-3: two prompts of
    3 (responses of 1): 2 x 3 + 2 x 1 = 8; 15 of 16 plain tokens, over 12 (the last bucket's 8
    alone would be under)."""
    ids = torch.tensor([[1, 5, 5, 5], [1, 6, 6, 6], [2, 2, 2, 7], [3, 3, 3, 7]])
    wanted = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1]])
    assert prompt_plan(ids, torch.ones_like(ids), wanted) is None
    wanted[3] = 0  # row 3 wants nothing: 7 + 3 + 1 = 11 tokens, shared
    assert [b.rows.tolist() for b in prompt_plan(ids, torch.ones_like(ids), wanted)] == [[0, 1], [2]]


def test_no_plan_when_sharing_saves_too_little():
    ids = torch.tensor([[1, 2, 7], [3, 4, 8]])  # two distinct prompts: nothing shared
    assert prompt_plan(ids, torch.ones_like(ids), torch.tensor([[0, 0, 1], [0, 0, 1]])) is None


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_shared_prompts_give_each_rows_own_log_probs_entropy_and_gradient(family):
    model = tiny_model(family).train()
    prompts, responses, batch = group_batch()
    mask = batch.loss_mask.bool()
    calls, handle = forward_calls(model)
    log_probs, entropy = token_log_probs(model, batch.input_ids, batch.attention_mask, 0.7, True,
                                         wanted=batch.loss_mask, share_prompts=True)
    handle.remove()
    # one prompt forward and one response forward per prompt length: (2 prompts of 4, then 1 of 6)
    assert [tuple(c) for c in calls][::2] == [(2, 4), (1, 6)]
    (log_probs[mask].sum() + entropy[mask].sum()).backward()
    shared_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = 0.0
    for row, (p, r) in enumerate(zip(prompts, responses)):  # the reference: each row alone
        logits = model(input_ids=torch.tensor([p + r])).logits[0].float() / 0.7
        own = torch.log_softmax(logits[len(p) - 1:-1], -1)
        want_lp = own.gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        keep = mask[row, len(p):len(p) + len(r)]
        torch.testing.assert_close(log_probs[row, len(p):len(p) + len(r)][keep].detach(), want_lp[keep].detach(),
                                   atol=2e-5, rtol=0)
        torch.testing.assert_close(entropy[row, len(p):len(p) + len(r)][keep],
                                   -(own.exp() * own).sum(-1)[keep].detach(), atol=2e-5, rtol=0)
        total = total + want_lp[keep].sum()
    # the entropy is a metric (no gradient); the loss's gradient reaches the prompt's weights through the cache
    total.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(shared_grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert shared_grads["model.embed_tokens.weight"][A].abs().sum() > 0  # prompt tokens' embeddings get gradient


def test_a_peft_model_and_a_model_that_keeps_no_cache_by_default_share_too():
    """Through PEFT's wrapper (LoRA: the HF model inside answers), and with the model config's
    use_cache off (the forward is asked for its cache): each row's own log-probs, entropy None when
    not asked for."""
    from megarl.backends.torch.lora import with_adapters
    from megarl.config_lora import LoraConfig

    prompts, responses, batch = group_batch()
    plain = tiny_model("qwen2")
    plain.config.use_cache = False
    adapted = with_adapters(tiny_model("qwen2"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for model in (plain, adapted):
        calls, handle = forward_calls(model.get_base_model() if model is adapted else model)
        with torch.no_grad():
            log_probs, entropy = token_log_probs(model, batch.input_ids, batch.attention_mask,
                                                 wanted=batch.loss_mask, share_prompts=True)
        handle.remove()
        assert len(calls) == 4 and entropy is None
        for row, (p, r) in enumerate(zip(prompts, responses)):
            with torch.no_grad():
                own = torch.log_softmax(model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1], -1)
            torch.testing.assert_close(log_probs[row, len(p):len(p) + len(r)],
                                       own.gather(-1, torch.tensor(r)[:, None]).squeeze(-1), atol=2e-5, rtol=0)


class _Older(torch.nn.Module):  # transformers before 5.2x: the cache is past_key_values
    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None, logits_to_keep=0):
        raise AssertionError("only the signature is read")


class _Newer(torch.nn.Module):
    def forward(self, input_ids, cache=None, logits_to_keep=0):
        raise AssertionError("only the signature is read")


class _NoLogitsToKeep(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None):
        raise AssertionError("only the signature is read")


class _NoCache(torch.nn.Module):
    def forward(self, input_ids, logits_to_keep=0):
        raise AssertionError("only the signature is read")


class _Wrapped(torch.nn.Module):  # a PEFT model: the base model's forward is the one that counts
    def forward(self, *args, **kwargs):
        raise AssertionError("only the signature is read")

    def get_base_model(self):
        return _Older()


@pytest.mark.parametrize("model, names", [(_Older(), ("past_key_values", "past_key_values")),
                                          (_Newer(), ("cache", "cache")), (_NoLogitsToKeep(), None),
                                          (_NoCache(), None), (_Wrapped(), ("past_key_values", "past_key_values"))])
def test_the_cache_argument_is_read_from_the_forwards_signature(model, names):
    assert cache_names(model) == names


def test_the_columns_before_a_rows_first_sampled_token_are_zero():
    model = tiny_model("qwen2")
    _, _, batch = group_batch()
    with torch.no_grad():
        log_probs, _ = token_log_probs(model, batch.input_ids, batch.attention_mask, wanted=batch.loss_mask,
                                       share_prompts=True)
    assert (log_probs[:, :4] == 0).all() and (log_probs[6:, :6] == 0).all()


@pytest.mark.parametrize("case", ["off", "checkpointing", "no wanted", "router logits"])
def test_what_takes_the_plain_forward(case):
    model = tiny_model("qwen3_moe" if case == "router logits" else "qwen2").train()
    if case == "checkpointing":  # HF turns the cache off under gradient checkpointing in training
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    _, _, batch = group_batch()
    calls, handle = forward_calls(model)
    token_log_probs(model, batch.input_ids, batch.attention_mask, wanted=None if case == "no wanted" else batch.loss_mask,
                    share_prompts=case != "off", router_logits=[] if case == "router logits" else None)
    handle.remove()
    assert len(calls) == 1 and tuple(calls[0]) == tuple(batch.input_ids.shape)


def test_an_update_with_shared_prompts_moves_the_weights_as_the_plain_one():
    """TorchActor.update_actor from the same weights on the same batch, prompts shared or not:
    the same weights after two optimizer steps, and the same loss metrics."""
    _, _, batch = group_batch()
    torch.manual_seed(0)
    batch = batch.with_fields(old_log_probs=-torch.rand(batch.input_ids.shape) - 1.0,
                              advantages=torch.randn(len(batch))[:, None].expand_as(batch.input_ids).contiguous())
    results = {}
    for share in (False, True):
        model = tiny_model("qwen2")
        actor = TorchActor(model, AlgorithmConfig(), OptimConfig(lr=1e-3, eps=1e-6), mini_batch_samples=3,
                           micro_batch_samples=3, share_prompts=share)
        metrics = actor.update_actor(batch)
        results[share] = ({n: p.detach().clone() for n, p in model.named_parameters()}, metrics)
    (plain, plain_metrics), (shared, shared_metrics) = results[False], results[True]
    for name in plain:
        torch.testing.assert_close(shared[name], plain[name], atol=2e-5, rtol=0, msg=name)
    assert shared_metrics["pg_loss"] == pytest.approx(plain_metrics["pg_loss"], abs=1e-5)
