"""The embedded engine's kept sequences: which slot keeps what, the longest kept prefix of a
prompt, oldest out first; and in the engine, a next turn that continues a finished sequence
computes only its new tokens, with log-probs still equal to a forward pass, and is admitted
before new requests that came earlier; prompts admitted together that start alike compute what
they share once."""

import asyncio

import torch

from megarl.rollout.engine import SamplingParams
from megarl.rollout import prefix_cache
from megarl.rollout.local import LocalEngine
from megarl.rollout.prefix_cache import KeptPrefixes, common_length, shared_prefixes
from tiny_models import reference_log_probs, tiny_model


def test_the_longest_kept_prefix_is_taken_once():
    kept = KeptPrefixes(first_slot=4, size=3)
    assert kept.keep((1, 2)) == 4 and kept.keep((1, 2, 3, 4)) == 5 and kept.keep((9,)) == 6
    assert kept.keep((1, 2)) is None  # kept already
    assert kept.take([1, 2, 3, 4, 5]) == (5, 4)  # the longer of (1, 2) and (1, 2, 3, 4)
    assert kept.take([1, 2, 3, 4, 5]) == (4, 2)  # (1, 2, 3, 4) was taken
    assert kept.take([1, 2]) is None  # a prompt must be longer than the kept sequence
    assert kept.take([2, 1, 9]) is None
    assert (kept.hits, kept.reused_tokens) == (2, 6)


def test_find_looks_without_taking():
    kept = KeptPrefixes(first_slot=0, size=2)
    kept.keep((1, 2, 3))
    kept.keep((7, 2, 3))  # the same last token, another sequence
    assert kept.find([7, 2, 3, 9]) == (1, 3) and kept.find([7, 2, 3, 9]) == (1, 3)
    assert kept.find([1, 2, 3]) is None  # not longer than the kept sequence
    assert (len(kept), kept.hits) == (2, 0)


def test_the_oldest_kept_goes_first_and_clear_forgets_all():
    kept = KeptPrefixes(first_slot=0, size=2)
    kept.keep((1,))
    kept.keep((2,))
    assert kept.keep((3,)) == 0  # (1,)'s slot
    assert kept.take([1, 5]) is None and kept.take([2, 5]) == (1, 1)
    kept.clear()
    assert kept.take([3, 5]) is None
    assert KeptPrefixes(first_slot=0, size=0).keep((1,)) is None


def test_a_slot_the_memory_cannot_hold_gives_way_to_the_oldest_or_nothing_is_kept():
    kept = KeptPrefixes(first_slot=0, size=3)
    assert kept.keep((1,)) == 0 and kept.keep((2,)) == 1
    assert kept.keep((3,), fits=lambda slot: slot < 2) == 0  # slot 2 does not fit: (1,)'s slot is reused
    assert kept.find([1, 5]) is None and kept.find([3, 5]) == (0, 1)
    assert kept.keep((4,), fits=lambda slot: False) is None and kept.not_kept == 1
    assert KeptPrefixes(first_slot=0, size=2).keep((1,), fits=lambda slot: False) is None


def test_a_next_turn_computes_only_its_new_tokens():
    model = tiny_model("qwen2")
    engine = LocalEngine(model, max_batch_size=2, eos_token_ids=[])
    computed = []
    prefill = engine.decoder.prefill

    def spy(first, prompts, cached=None):
        computed.append([len(p) - c for p, c in zip(prompts, cached or [0] * len(prompts))])
        return prefill(first, prompts, cached)

    engine.decoder.prefill = spy
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)

    async def turns():
        first = await engine.generate([5, 6, 7, 8], params)
        history = [5, 6, 7, 8, *first.token_ids, 40, 41, 42]  # the output, then an observation
        second = await engine.generate(history, params)
        await engine.update_weights([{}], version=1)  # new weights: the kept caches are stale
        third = await engine.generate([*history, *second.token_ids, 50], params)
        await engine.close()
        return first, history, second, third

    first, history, second, third = asyncio.run(turns())
    # turn 2: the kept cache holds the prompt and all outputs but the last (never fed back), so
    # that last output and the observation are computed: 1 + 3; turn 3: everything again
    assert computed == [[4], [4], [len(history) + 6 + 1]]
    assert engine.kept.hits == 1 and engine.kept.reused_tokens == 4 + 5
    for prompt, out in ((history, second), ([*history, *second.token_ids, 50], third)):
        torch.testing.assert_close(torch.tensor(out.log_probs), reference_log_probs(model, prompt, out.token_ids),
                                   atol=1e-5, rtol=0)


def test_a_next_turn_is_admitted_before_new_requests_that_came_first():
    # one slot and one kept sequence: first-come order would run the two new prompts first, and
    # the first of them, once finished, would push the trajectory's kept sequence out
    model = tiny_model("qwen2")
    engine = LocalEngine(model, max_batch_size=1, kept_sequences=1, eos_token_ids=[])
    order = []
    prefill = engine.decoder.prefill

    def spy(first, prompts, cached=None):
        order.extend(tuple(p[:2]) for p in prompts)
        return prefill(first, prompts, cached)

    engine.decoder.prefill = spy
    params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=2)

    async def run():
        first = await engine.generate([5, 6, 7], params)
        history = [5, 6, 7, *first.token_ids, 30, 31]
        outs = await asyncio.gather(engine.generate([20, 21, 22], params), engine.generate([25, 26], params),
                                    engine.generate(history, params))
        await engine.close()
        return first, history, outs

    first, history, outs = asyncio.run(run())
    assert order == [(5, 6), (5, 6), (20, 21), (25, 26)]  # the next turn went first
    assert engine.kept.hits == 1 and engine.kept.reused_tokens == 3 + 3 - 1
    torch.testing.assert_close(torch.tensor(outs[2].log_probs), reference_log_probs(model, history, outs[2].token_ids),
                               atol=1e-5, rtol=0)


def test_common_length_counts_the_equal_first_tokens():
    rng = torch.Generator().manual_seed(0)
    for _ in range(300):
        a, b = (tuple(torch.randint(0, 2, (int(torch.randint(0, 12, (1,), generator=rng)),), generator=rng).tolist())
                for _ in range(2))
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:  # the obvious way
            n += 1
        assert common_length(a, b) == n, (a, b)


def test_prompts_that_start_alike_are_grouped_by_what_they_share():
    template = tuple(range(100, 200))  # 100 tokens every prompt of the first kind starts with
    prompts = [template + (1, 2), (7,) * 40 + (3,), template + (5,), (7,) * 40 + (4, 4), template + (6, 6, 6)]
    # indices in sorted order; 3 x 100 tokens and 1 x 40 computed once instead of again
    assert shared_prefixes(prompts, min_saving=40) == [([1, 3], 40), ([0, 2, 4], 100)]
    assert shared_prefixes(prompts, min_saving=41) == [([0, 2, 4], 100)]  # 40 tokens saved are too few
    # every prompt keeps a token to compute its logits from: the template alone shares 99
    assert shared_prefixes([template, template + (1,)], min_saving=1) == [([0, 1], 99)]
    # a neighbour that would shrink what the group shares below what it saves starts a group of its own
    near = [template + (1,), template + (2,), template[:10] + (0,) * 50]
    assert shared_prefixes(near, min_saving=1) == [([0, 1], 100)]  # not all three sharing 10
    assert shared_prefixes([(1, 2, 3)], min_saving=0) == []  # one prompt shares nothing


def test_prompts_admitted_together_compute_their_shared_start_once(monkeypatch):
    model = tiny_model("qwen2")
    template = torch.randint(1, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [template + [50 + i, 60 + i] for i in range(4)] + [[9, 8, 7]]
    params = [SamplingParams(max_new_tokens=5, temperature=1.0, seed=i) for i in range(len(prompts))]

    def run(kept_sequences):
        engine = LocalEngine(model, max_batch_size=8, kept_sequences=kept_sequences, eos_token_ids=[])
        computed = []
        prefill = engine.decoder.prefill

        def spy(first, batch, cached=None):
            computed.append(sum(len(p) - c for p, c in zip(batch, cached or [0] * len(batch))))
            return prefill(first, batch, cached)

        engine.decoder.prefill = spy

        async def go():
            outs = await asyncio.gather(*[engine.generate(p, q) for p, q in zip(prompts, params)])
            await engine.close()
            return outs

        return asyncio.run(go()), computed, engine.shared_prefix_tokens

    monkeypatch.setattr(prefix_cache, "SHARED_PREFIX_MIN_SAVING", 100)  # 3 x 40 tokens saved: enough
    outs, computed, shared = run(kept_sequences=None)
    # the 40 template tokens once, then each prompt's 2 own tokens and the other prompt's 3
    assert computed == [40, 4 * 2 + 3] and shared == 3 * 40
    for p, o in zip(prompts, outs):
        torch.testing.assert_close(torch.tensor(o.log_probs), reference_log_probs(model, p, o.token_ids),
                                   atol=1e-5, rtol=0)
    plain, computed, shared = run(kept_sequences=0)  # no prefix reuse: every token computed
    assert computed == [4 * 42 + 3] and shared == 0
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs]  # seeded: the same samples
