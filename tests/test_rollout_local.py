"""The embedded engine: exact log-probs, greedy = HF generate, sampling controls, batching,
stop conditions, weight updates, pause / cancel."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megarl.rollout.engine import RolloutEngine, SamplingParams
from megarl.rollout.local import LocalEngine
from tiny_models import reference_log_probs, tiny_model, tiny_tokenizer


def run(coro):
    return asyncio.run(coro)


def prompts_of(lengths, seed=1, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


async def generate_all(engine, prompts, params_of):
    try:
        return await asyncio.gather(*[engine.generate(p, params_of(i)) for i, p in enumerate(prompts)])
    finally:
        await engine.close()


def test_a_decode_step_splits_the_keys_of_one_long_row_from_the_short_ones():
    from megarl.rollout.decoder import _split_keys

    # rows attend over 3, 3, 4 and 301 keys; cutting at 4 computes 4 * 4 keys plus the long
    # row's 297 tail keys twice (610) instead of 4 * 301 (1204)
    split = _split_keys(torch.tensor([2, 2, 3, 300]), key_len=301, device="cpu")
    assert (split.cut, split.key_len, split.long_rows.tolist()) == (4, 301, [3])
    assert split.head_mask.shape == (4, 1, 1, 4) and split.head_mask[0].sum() == 3
    assert split.tail_mask.shape == (1, 1, 1, 297) and bool(split.tail_mask.all())
    assert _split_keys(torch.tensor([40, 41, 44]), key_len=45, device="cpu") is None  # alike: one pass


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_log_probs_stay_exact_when_a_step_splits_its_keys(family):
    model = tiny_model(family)
    engine = LocalEngine(model, max_batch_size=4, eos_token_ids=[])
    split = engine.decoder._split_attention
    calls = []
    engine.decoder._split_attention = lambda *a: calls.append(1) or split(*a)
    prompts = prompts_of([400, 3, 7, 2])
    outs = run(generate_all(engine, prompts, lambda i: SamplingParams(max_new_tokens=6, temperature=1.0, seed=i)))
    assert calls  # the long row's keys were computed apart
    for p, o in zip(prompts, outs):
        torch.testing.assert_close(torch.tensor(o.log_probs), reference_log_probs(model, p, o.token_ids),
                                   atol=1e-5, rtol=0)

@pytest.mark.parametrize("family, tie", [("qwen2", False), ("qwen2", True), ("qwen3", False), ("llama", False)])
def test_log_probs_equal_a_forward_pass(family, tie):
    model = tiny_model(family, tie=tie)
    engine = LocalEngine(model, max_batch_size=4, eos_token_ids=[])
    assert isinstance(engine, RolloutEngine)
    prompts = prompts_of([3, 17, 5, 9, 30, 1])  # uneven, more prompts than slots
    outs = run(generate_all(engine, prompts, lambda i: SamplingParams(max_new_tokens=4 + 3 * i, temperature=0.7, seed=i)))
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert len(o.token_ids) == 4 + 3 * i and o.finish_reason == "length"
        ref = reference_log_probs(model, p, o.token_ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(o.log_probs), ref, atol=1e-5, rtol=0)


def test_the_samples_of_a_prompt_share_one_prefill_and_stay_exact():
    model = tiny_model("qwen2")
    engine = LocalEngine(model, max_batch_size=8, eos_token_ids=[])
    prefilled = []
    prefill = engine.decoder.prefill
    engine.decoder.prefill = lambda first, prompts, *rest: prefilled.append([len(p) for p in prompts]) or prefill(
        first, prompts, *rest)
    a, b = prompts_of([11, 6])
    prompts = [a, b, a, a, b, a]  # two groups, interleaved, admitted in one step
    outs = run(generate_all(engine, prompts, lambda i: SamplingParams(max_new_tokens=5 + i, temperature=1.0, seed=i)))
    assert prefilled == [[11, 6]]  # each prompt once
    assert len({tuple(o.token_ids[:5]) for o in outs}) > 2  # the samples still differ
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert len(o.token_ids) == 5 + i
        torch.testing.assert_close(torch.tensor(o.log_probs), reference_log_probs(model, p, o.token_ids),
                                   atol=1e-5, rtol=0)


def test_cache_growth_and_slot_reuse_stay_exact():
    # a cache that starts tiny must grow during decoding, and finished sequences must hand
    # their slots to waiting ones, without changing any log-prob
    model = tiny_model("qwen2")
    engine = LocalEngine(model, max_batch_size=3, eos_token_ids=[])
    engine.decoder.release()
    engine.decoder.ensure(1, 4)
    prompts = prompts_of([2, 9, 4, 6, 3, 12, 5])
    outs = run(generate_all(engine, prompts, lambda i: SamplingParams(max_new_tokens=3 + 7 * (i % 3), seed=i)))
    assert engine.decoder.running.capacity > 4
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert len(o.token_ids) == 3 + 7 * (i % 3)
        torch.testing.assert_close(torch.tensor(o.log_probs), reference_log_probs(model, p, o.token_ids),
                                   atol=1e-5, rtol=0)


def test_greedy_equals_hf_generate():
    model = tiny_model("qwen2")
    prompts = prompts_of([4, 11, 7])
    engine = LocalEngine(model, max_batch_size=2, eos_token_ids=[])
    outs = run(generate_all(engine, prompts, lambda i: SamplingParams(max_new_tokens=12, temperature=0.0)))
    for p, o in zip(prompts, outs):
        ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        assert o.token_ids == ref[0, len(p):].tolist()


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    model = tiny_model("qwen2")
    prompts = prompts_of([5] * 6)

    def sample(seeds):
        engine = LocalEngine(model, max_batch_size=3, eos_token_ids=[])
        return [o.token_ids for o in run(generate_all(
            engine, prompts, lambda i: SamplingParams(max_new_tokens=16, temperature=1.0, seed=seeds[i])))]

    first, again, other = sample(range(6)), sample(range(6)), sample(range(100, 106))
    assert first == again
    assert first != other


def test_top_k_one_and_tiny_top_p_are_greedy():
    model = tiny_model("qwen2")
    prompts = prompts_of([6, 8])
    greedy = run(generate_all(LocalEngine(model, eos_token_ids=[]), prompts,
                              lambda i: SamplingParams(max_new_tokens=10, temperature=0.0)))
    for params in (SamplingParams(max_new_tokens=10, temperature=1.5, top_k=1, seed=3),
                   SamplingParams(max_new_tokens=10, temperature=1.5, top_p=1e-6, seed=3)):
        outs = run(generate_all(LocalEngine(model, eos_token_ids=[]), prompts, lambda i: params))
        assert [o.token_ids for o in outs] == [o.token_ids for o in greedy]


def test_stop_token_ids_and_eos_finish_with_stop():
    model = tiny_model("qwen2")
    (prompt,) = prompts_of([6])
    free = run(generate_all(LocalEngine(model, eos_token_ids=[]), [prompt],
                            lambda i: SamplingParams(max_new_tokens=20, temperature=0.0)))[0]
    stop_at = 5
    stop_id = free.token_ids[stop_at]
    first = free.token_ids.index(stop_id)  # generation stops at its first occurrence
    for engine, params in ((LocalEngine(model, eos_token_ids=[]), SamplingParams(max_new_tokens=20, temperature=0.0,
                                                                                  stop_token_ids=(stop_id,))),
                           (LocalEngine(model, eos_token_ids=[stop_id]), SamplingParams(max_new_tokens=20, temperature=0.0))):
        (out,) = run(generate_all(engine, [prompt], lambda i: params))
        assert out.token_ids == free.token_ids[: first + 1]
        assert (out.finish_reason, out.matched_stop) == ("stop", stop_id)
    (out,) = run(generate_all(LocalEngine(model, eos_token_ids=[stop_id]), [prompt],
                              lambda i: SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)))
    assert out.token_ids == free.token_ids and out.finish_reason == "length"


def test_stop_string_ends_at_the_token_that_completes_it():
    tok = tiny_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tok))
    prompt = tok.encode("<search> capital")
    free = run(generate_all(LocalEngine(model, tok, eos_token_ids=[]), [prompt],
                            lambda i: SamplingParams(max_new_tokens=24, temperature=0.0)))[0]
    text = tok.decode(free.token_ids)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    # the slow reference: the shortest prefix of the free output whose text contains the stop string
    expected = next(k for k in range(1, len(free.token_ids) + 1) if stop in tok.decode(free.token_ids[:k]))
    (out,) = run(generate_all(LocalEngine(model, tok, eos_token_ids=[]), [prompt],
                              lambda i: SamplingParams(max_new_tokens=24, temperature=0.0, stop=(stop,))))
    assert out.token_ids == free.token_ids[:expected]
    assert (out.finish_reason, out.matched_stop) == ("stop", stop)


def test_update_weights_changes_the_next_generation():
    model, other = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=7)
    engine = LocalEngine(model, eos_token_ids=[])
    (prompt,) = prompts_of([8])

    async def scenario():
        before = await engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0.0))
        state = other.state_dict()
        names = list(state)
        buckets = [{n: state[n] for n in names[: len(names) // 2]}, {n: state[n] for n in names[len(names) // 2:]}]
        await engine.update_weights(buckets, version=3)
        after = await engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0.0))
        await engine.close()
        return before, after

    before, after = run(scenario())
    assert after.weight_version == 3 and before.weight_version == 0
    torch.testing.assert_close(torch.tensor(after.log_probs), reference_log_probs(other, prompt, after.token_ids),
                               atol=1e-5, rtol=0)
    assert before.token_ids != after.token_ids


def test_update_weights_rejects_unknown_names_and_shapes():
    engine = LocalEngine(tiny_model("qwen2"), eos_token_ids=[])
    with pytest.raises(KeyError, match="model.layers.9"):
        run(engine.update_weights([{"model.layers.9.mlp.up_proj.weight": torch.zeros(1)}], 1))
    with pytest.raises(ValueError, match="expects"):
        run(engine.update_weights([{"lm_head.weight": torch.zeros(3, 3)}], 1))


def test_pause_holds_requests_and_resume_finishes_them():
    engine = LocalEngine(tiny_model("qwen2"), eos_token_ids=[])
    (prompt,) = prompts_of([5])

    async def scenario():
        await engine.pause()
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0.0)))
        await asyncio.sleep(0.3)
        held = not task.done()
        await engine.resume()
        out = await asyncio.wait_for(task, 30)
        await engine.close()
        return held, out

    held, out = run(scenario())
    assert held and len(out.token_ids) == 6


def test_cancelled_request_frees_its_slot():
    engine = LocalEngine(tiny_model("qwen2"), max_batch_size=1, eos_token_ids=[])
    long_prompt, short_prompt = prompts_of([5, 5])

    async def scenario():
        slow = asyncio.create_task(engine.generate(long_prompt, SamplingParams(max_new_tokens=100_000, temperature=0.0)))
        await asyncio.sleep(0.2)
        slow.cancel()
        out = await asyncio.wait_for(engine.generate(short_prompt, SamplingParams(max_new_tokens=3, temperature=0.0)), 30)
        await engine.close()
        return out

    assert len(run(scenario()).token_ids) == 3


def test_a_step_that_fails_answers_every_request_it_took():
    # a token id past the vocabulary fails the prefill; the requests admitted with it, no longer
    # waiting and not yet running, must be answered too (they used to wait forever)
    model = tiny_model("qwen2")
    engine = LocalEngine(model, max_batch_size=4, eos_token_ids=[])
    prompts = [[1, 2, 3], [4, 5, model.config.vocab_size + 7], [6, 7]]
    outs = run(asyncio.wait_for(generate_all(engine, prompts, lambda i: SamplingParams(max_new_tokens=3)), 60))
    assert [o.finish_reason for o in outs] == ["abort"] * 3
    assert all("engine step failed" in o.message for o in outs)


def test_bad_requests():
    engine = LocalEngine(tiny_model("qwen2"), eos_token_ids=[])
    with pytest.raises(ValueError, match="empty"):
        run(engine.generate([], SamplingParams()))
    with pytest.raises(ValueError, match="tokenizer"):
        run(engine.generate([1, 2], SamplingParams(stop=("x",))))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="unsupported sampling_params"):
        SamplingParams.from_sglang({"temperature": 1.0, "frequency_penalty": 0.5})


def test_qwen3_moe_log_probs_and_weights_by_checkpoint_name():
    import copy

    from megarl.models.hf_layout import checkpoint_views
    from tiny_models import tiny_hf_model

    first, second = tiny_hf_model("qwen3_moe", seed=0), tiny_hf_model("qwen3_moe", seed=1)
    engine = LocalEngine(copy.deepcopy(first), max_batch_size=3, eos_token_ids=[])
    prompts = prompts_of([3, 17, 5, 9])
    params = lambda i: SamplingParams(max_new_tokens=5, temperature=1.0, seed=i)  # noqa: E731

    async def both():
        before = await asyncio.gather(*[engine.generate(p, params(i)) for i, p in enumerate(prompts)])
        # the trainer's tensors arrive by checkpoint name: one per expert, not transformers' fused 3-D ones
        bucket = {n: t.clone() for n, t in checkpoint_views(second).items()}
        assert "model.layers.0.mlp.experts.5.gate_proj.weight" in bucket
        await engine.update_weights([bucket], version=1)
        after = await asyncio.gather(*[engine.generate(p, params(i)) for i, p in enumerate(prompts)])
        await engine.close()
        return before, after

    before, after = run(both())
    for model, outs in ((first, before), (second, after)):
        for p, o in zip(prompts, outs):
            torch.testing.assert_close(torch.tensor(o.log_probs), reference_log_probs(model, p, o.token_ids),
                                       atol=1e-5, rtol=0)
