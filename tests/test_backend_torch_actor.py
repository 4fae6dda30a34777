"""Torch backend actor: log-probs like the engine's, split-invariant updates, the first step
against a hand-derived gradient."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from megarl.backends.batch import TrainBatch
from megarl.backends.torch.actor import TorchActor, build_optimizer
from megarl.backends.torch.logprobs import token_log_probs
from megarl.config import AlgorithmConfig, OptimConfig
from megarl.rollout.engine import SamplingParams
from megarl.rollout.local import LocalEngine
from tiny_models import tiny_model


def random_batch(seed=0, rows=8, vocab=300):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (3 + i % 4,), generator=g).tolist() for i in range(rows)]
    responses = [torch.randint(1, vocab, (2 + (5 * i) % 7,), generator=g).tolist() for i in range(rows)]
    # an observation in the middle of some responses: mask 0 there
    masks = [[0 if (i % 3 == 0 and 1 <= t <= 2) else 1 for t in range(len(r))] for i, r in enumerate(responses)]
    return TrainBatch.from_sequences(prompts, responses, masks), g


def test_batch_layout():
    batch = TrainBatch.from_sequences([[5, 6], [7]], [[8, 9, 10], [11]], [[1, 0, 1], [1]], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 8, 9, 10], [7, 11, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="mask of 1"):
        TrainBatch.from_sequences([[1]], [[2, 3]], [[1]])


def test_log_probs_match_the_engine_like_with_like():
    model = tiny_model("qwen2")
    engine = LocalEngine(model, eos_token_ids=[])
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]

    async def go():
        outs = await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=6, temperature=0.7, seed=i))
                                      for i, p in enumerate(prompts)])
        await engine.close()
        return outs

    outs = asyncio.run(go())
    batch = TrainBatch.from_sequences(prompts, [o.token_ids for o in outs], [[1] * 6] * 2,
                                      rollout_log_probs=[o.log_probs for o in outs])
    actor = TorchActor(model, AlgorithmConfig(), OptimConfig(), mini_batch_samples=2, micro_batch_samples=1,
                       temperature=0.7)
    log_probs, entropy = actor.compute_log_prob(batch, with_entropy=True)
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(log_probs[mask], batch.rollout_log_probs[mask], atol=1e-5, rtol=0)
    assert (entropy[mask] > 0).all()


def test_log_probs_of_the_wanted_columns_only():
    """With the loss mask as `wanted`, the LM head sees the columns from the first wanted one on,
    and the log-probs and entropy there are those of each row's own forward pass, one softmax at a
    time; the entropy carries a gradient only when asked to."""
    model = tiny_model("qwen2")
    prompts, responses = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], [[20, 21, 22], [23, 24]]
    batch = TrainBatch.from_sequences(prompts, responses, [[1, 0, 1], [1, 1]])
    seen = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out.shape[1]))
    log_probs, entropy = token_log_probs(model, batch.input_ids, batch.attention_mask, 0.7, True,
                                         wanted=batch.loss_mask)
    hook.remove()
    assert seen == [batch.input_ids.shape[1] - 4 + 1]  # the first response token is column 4
    assert not entropy.requires_grad and log_probs.requires_grad
    for row, (p, r) in enumerate(zip(prompts, responses)):
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float() / 0.7
        for t in range(len(p), len(p) + len(r)):
            want = torch.log_softmax(logits[t - 1], -1)
            torch.testing.assert_close(log_probs[row, t].detach(), want[ids[0, t]], atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy[row, t], -(want.exp() * want).sum(), atol=1e-5, rtol=0)
    assert (log_probs[:, :4] == 0).all()
    _, entropy = token_log_probs(model, batch.input_ids, batch.attention_mask, 0.7, True,
                                 wanted=batch.loss_mask, entropy_grad=True)
    assert entropy.requires_grad


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_update_does_not_depend_on_the_micro_batch_split(mode):
    batch, g = random_batch()
    base = tiny_model("qwen2")
    algo = AlgorithmConfig(loss_agg_mode=mode, entropy_coeff=0.01)
    # Adam's first step moves a weight by lr * g / (|g| + eps): with the default eps (1e-8) a
    # weight whose gradient is near zero turns the summation-order rounding of g (~1e-9) into
    # an update difference of up to lr; eps = 1e-3 bounds that by (lr / eps) x the rounding,
    # while a wrong normalisation (a factor on g) still moves every weight visibly
    optim = OptimConfig(lr=1e-3, eps=1e-3, lr_warmup_steps=0, weight_decay=0.0)
    old, _ = TorchActor(base, algo, optim, mini_batch_samples=8, micro_batch_samples=8).compute_log_prob(batch)
    batch = batch.with_fields(old_log_probs=old + 0.05 * torch.randn(old.shape, generator=g),
                              advantages=torch.randn(old.shape, generator=g))
    results = []
    for micro in (8, 2, 1):
        model = copy.deepcopy(base)
        metrics = TorchActor(model, algo, optim, mini_batch_samples=8, micro_batch_samples=micro,
                             norm_length=12).update_actor(batch)
        results.append((model.state_dict(), metrics))
    for state, metrics in results[1:]:
        for name, tensor in results[0][0].items():
            torch.testing.assert_close(state[name], tensor, atol=2e-6, rtol=0)
        assert metrics["grad_norm"] == pytest.approx(results[0][1]["grad_norm"], rel=1e-4)
        assert metrics["pg_loss"] == pytest.approx(results[0][1]["pg_loss"], abs=1e-6)


def test_first_step_follows_the_hand_derived_gradient():
    # old = current log-probs, so every ratio is 1 (inside the clip): the token-mean loss is
    # L = -Σ A_t·exp(logp_t - sg(logp_t)) / N, with gradient -Σ A_t ∇logp_t / N. Adam's first
    # step (no weight decay) moves every weight by -lr·g/(|g| + eps).
    batch, g = random_batch(seed=3)
    model = tiny_model("qwen2")
    reference = copy.deepcopy(model)
    optim = OptimConfig(lr=1e-4, lr_warmup_steps=0, weight_decay=0.0, grad_clip=0.0)
    actor = TorchActor(model, AlgorithmConfig(), optim, mini_batch_samples=8, micro_batch_samples=4)
    old, _ = actor.compute_log_prob(batch)
    advantages = torch.randn(old.shape, generator=g)
    actor.update_actor(batch.with_fields(old_log_probs=old, advantages=advantages))

    logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.loss_mask[:, 1:].float()
    loss = -(advantages[:, 1:] * logp * mask).sum() / mask.sum()
    loss.backward()
    after = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        expected = p.detach() - 1e-4 * p.grad / (p.grad.abs() + 1e-8)
        torch.testing.assert_close(after[name].detach(), expected, atol=1e-6, rtol=0)


def test_nan_gradient_skips_the_step():
    batch, _ = random_batch()
    model = tiny_model("qwen2")
    before = copy.deepcopy(model.state_dict())
    actor = TorchActor(model, AlgorithmConfig(), OptimConfig(lr=1e-3), mini_batch_samples=8, micro_batch_samples=4)
    old, _ = actor.compute_log_prob(batch)
    advantages = torch.zeros_like(old)
    advantages[0, -1] = float("nan")
    batch = batch.with_fields(old_log_probs=old, advantages=advantages)
    batch.loss_mask[0, -1] = 1
    metrics = actor.update_actor(batch)
    assert metrics["skipped_steps"] == 1.0
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name])


@pytest.mark.parametrize("scheduler, expected", [
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0]),
    # warm-up 2 steps, then cosine over the remaining 3 steps towards 10% (reached after the
    # last step): progress 0, 1/3, 2/3 -> 0.1 + 0.9·0.5·(1 + cos(pi·p)) = 1.0, 0.775, 0.325
    ("cosine", [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + 0.5), 0.1 + 0.45 * (1 - 0.5)]),
])
def test_lr_schedule(scheduler, expected):
    model = torch.nn.Linear(2, 2)
    optim = OptimConfig(lr=1.0, lr_warmup_steps=2, lr_scheduler=scheduler, min_lr_ratio=0.1)
    optimizer, schedule = build_optimizer(model, optim, total_steps=5)
    seen = []
    for _ in range(5):
        seen.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert seen == pytest.approx(expected)
