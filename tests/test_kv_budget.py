"""The embedded engine's K/V cache sized by a budget of positions, not by max_batch_size: it
admits what fits, grows with use, lets kept sequences give way, refuses what can never fit, and
its default comes from the memory available."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megarl.rollout import decoder
from megarl.rollout.engine import SamplingParams
from megarl.rollout.decoder import default_kv_cache_tokens
from megarl.rollout.local import LocalEngine
from tiny_models import reference_log_probs, tiny_model


def prompts_of(lengths, seed=3, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


class Watch:
    """After each engine step: the running sequences and the positions both caches hold."""

    def __init__(self, engine: LocalEngine):
        self.running, self.positions = [], []
        step = engine._step

        def watched(admitted):
            finished = step(admitted)
            self.running.append(len(engine._running) + len(finished))
            self.positions.append(engine.decoder.running.positions + engine.decoder.kept.positions)
            return finished

        engine._step = watched


def test_requests_are_admitted_while_what_they_may_reach_fits():
    # each request: 5 prompt tokens + 14 new = 19 positions, one more for the token being
    # computed: 20. A budget of 60 holds 3 such sequences at once, though 8 may run.
    model = tiny_model("qwen2")
    engine = LocalEngine(model, max_batch_size=8, kept_sequences=0, eos_token_ids=[], kv_cache_tokens=60)
    watch = Watch(engine)
    prompts = prompts_of([5] * 7)
    params = [SamplingParams(max_new_tokens=14, seed=i) for i in range(7)]

    async def go():
        try:
            return await asyncio.gather(*[engine.generate(p, q) for p, q in zip(prompts, params)])
        finally:
            await engine.close()

    outs = asyncio.run(go())
    assert max(watch.running) == 3 and max(watch.positions) <= 60
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 14
        torch.testing.assert_close(torch.tensor(out.log_probs), reference_log_probs(model, prompt, out.token_ids),
                                   atol=1e-5, rtol=0)


def test_the_cache_follows_use_not_max_batch_size():
    # 1024 slots allowed: four sequences of 6 + 4 positions make a cache of 4 rows, not 1024
    engine = LocalEngine(tiny_model("qwen2"), max_batch_size=1024, eos_token_ids=[], kv_cache_tokens=10**6)
    watch = Watch(engine)

    async def go():
        try:
            return await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=4, seed=1))
                                          for p in prompts_of([6] * 4)])
        finally:
            await engine.close()

    asyncio.run(go())
    assert engine.decoder.running.rows == 4 and engine.decoder.running.capacity == 16  # 11 positions, at least 16
    assert max(watch.positions) == 4 * 16 + engine.decoder.kept.positions


def test_a_request_that_can_never_fit_is_refused_at_once():
    engine = LocalEngine(tiny_model("qwen2"), max_batch_size=4, eos_token_ids=[], kv_cache_tokens=30)

    async def go():
        try:
            await engine.generate(list(range(1, 21)), SamplingParams(max_new_tokens=10))
        finally:
            await engine.close()

    with pytest.raises(ValueError, match=r"20 tokens with max_new_tokens=10 needs 31 positions .* holds 30 "
                                         r"\(rollout.kv_cache_tokens\)"):
        asyncio.run(go())


def test_kept_sequences_give_way_to_running_ones():
    # a budget of 40 positions. The first request (7 prompt tokens, 6 new) finishes holding 12
    # positions (its last token is never fed back): kept, beside the running cache's 16. Then
    # two requests of 9 + 10 may reach 20 positions each: 40 with nothing kept, so the kept
    # sequence is forgotten and its cache freed. They finish at 18 positions each, in a running
    # cache of 2 x 18 (doubling to 2 x 32 would pass the budget): 36 + 18 > 40, neither is kept.
    model = tiny_model("qwen2")
    engine = LocalEngine(model, max_batch_size=4, kept_sequences=2, eos_token_ids=[], kv_cache_tokens=40)
    prompts = prompts_of([9, 9])

    async def go():
        try:
            await engine.generate([5, 6, 7, 8, 9, 10, 11], SamplingParams(max_new_tokens=6, seed=4))
            kept = (len(engine.kept), engine.decoder.kept.rows, engine.decoder.kept.capacity)
            outs = await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=10, seed=i))
                                          for i, p in enumerate(prompts)])
            return kept, outs
        finally:
            await engine.close()

    kept, outs = asyncio.run(go())
    assert kept == (1, 1, 12)
    assert (len(engine.kept), engine.kept.not_kept, engine.decoder.kept.positions) == (0, 2, 0)
    assert (engine.decoder.running.rows, engine.decoder.running.capacity) == (2, 18)
    for prompt, out in zip(prompts, outs):
        torch.testing.assert_close(torch.tensor(out.log_probs), reference_log_probs(model, prompt, out.token_ids),
                                   atol=1e-5, rtol=0)


def test_the_default_budget_is_a_quarter_of_the_memory_available(monkeypatch):
    import psutil

    class Memory:
        available = 2_000_000_000

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    engine = LocalEngine(tiny_model("qwen2"), max_batch_size=4, eos_token_ids=[])
    # the tiny Qwen2: K and V x 2 layers x 2 K/V heads x head_dim 16 x 4 bytes = 512 bytes a position
    assert engine.decoder.bytes_per_token == 512
    assert engine.decoder.max_tokens == default_kv_cache_tokens(engine.decoder) == 500_000_000 // 512
    assert decoder.KV_CACHE_MEMORY_SHARE == 0.25
