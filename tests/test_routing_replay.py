"""Routing replay of a mixture of experts: the embedded engine records the experts of every
token (prefix reuse, copies of a prompt's cache, continued generations and multi-turn
trajectories included), the trainer's forwards route as recorded. References: HF's own router
over the whole sequence, and one MoE block computed token by token by hand."""

from __future__ import annotations

import asyncio

import pytest
import torch

from megarl.backends.batch import TrainBatch
from megarl.backends.moe import replay_indices
from megarl.backends.torch.logprobs import token_log_probs
from megarl.backends.torch.routing import replayed_routing
from megarl.rollout.agent import AgentSettings, Trajectory, generate_continued, run_trajectory
from megarl.rollout.engine import SamplingParams
from megarl.rollout.local import LocalEngine
from tiny_models import tiny_hf_model, tiny_tokenizer

TOPK = 2


def own_routing(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), MoE layers x k): HF's router over the whole sequence, top k of its logits,
    each layer's k in ascending order."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    return torch.cat([torch.topk(logits, TOPK, dim=-1).indices.sort(dim=-1).values for logits in out.router_logits], 1)


def ascending(routed: torch.Tensor) -> torch.Tensor:
    """Each layer's k experts in ascending order (an engine's order is by probability)."""
    rows, width = routed.shape
    return routed.long().view(rows, width // TOPK, TOPK).sort(dim=-1).values.view(rows, width)


def prompts_of(lengths, seed=3, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def test_the_engine_records_every_tokens_experts_through_prefix_reuse_and_copies():
    model = tiny_hf_model("qwen3_moe")  # 4 layers, layer 1 dense: 3 MoE layers of top-2
    engine = LocalEngine(model, max_batch_size=3, eos_token_ids=[], record_routing=True)
    first, other = prompts_of([9, 14])
    params = lambda i, start: SamplingParams(max_new_tokens=6, seed=i, routed_experts_from=start)  # noqa: E731

    async def turns():
        try:
            # the n samples of a prompt (one prefill, copies of its cache), another prompt, all from position 0
            outs = await asyncio.gather(*[engine.generate(p, params(i, 0)) for i, p in enumerate([first, first, other])])
            # the next turn of the first: its kept cache (and routing) reused; rows from where the first left off
            nxt = first + outs[0].token_ids + [5, 6, 7]
            later = await engine.generate(nxt, params(9, len(first) + 6 - 1))
            return outs, nxt, later
        finally:
            await engine.close()

    outs, nxt, later = asyncio.run(turns())
    assert engine.kept.hits == 1
    for prompt, out in zip([first, first, other], outs):
        whole = prompt + out.token_ids
        assert out.routed_experts.dtype == torch.int16 and out.routed_experts.shape == (len(whole) - 1, 3 * TOPK)
        assert torch.equal(ascending(out.routed_experts), own_routing(model, whole)[:-1])
    whole = nxt + later.token_ids
    assert later.routed_experts.shape == (len(whole) - len(first) - 6, 3 * TOPK)
    assert torch.equal(ascending(later.routed_experts), own_routing(model, whole)[len(first) + 5:-1])


class NoSearches:
    async def search(self, queries, topk=3):
        raise AssertionError("a random model does not search")


def test_routing_goes_on_across_a_preempted_generation_and_the_turns_of_a_trajectory():
    model = tiny_hf_model("qwen3_moe")
    tok = tiny_tokenizer()
    engine = LocalEngine(model, max_batch_size=2, eos_token_ids=[], record_routing=True, tokenizer=tok)
    prompt = prompts_of([11])[0]
    settings = AgentSettings(max_turns=2, max_turn_length=5, max_obs_length=8, max_response_length=600,
                             routed_experts=True)

    async def both():
        try:
            # a generation preempted after its first step goes on from its tokens (partial rollouts)
            one = Trajectory(prompt_ids=list(prompt))
            task = asyncio.ensure_future(generate_continued(engine, tok, prompt, SamplingParams(
                max_new_tokens=8, seed=2, routed_experts_from=0), one))
            while engine.tokens_generated < 2:
                await asyncio.sleep(0.001)
            await engine.abort_requests()
            continued = await task
            # a trajectory of three turns (a random model's turns are invalid actions: each gets
            # the invalid-action message, and the next turn sends the whole history)
            traj = await run_trajectory(engine, tok, prompt, settings, tools=NoSearches(), seed=3)
            return one, continued, traj
        finally:
            await engine.close()

    one, continued, traj = asyncio.run(both())
    assert one.num_continued == 1 and len(continued.token_ids) == 8
    whole = prompt + continued.token_ids
    assert torch.equal(ascending(continued.routed_experts), own_routing(model, whole)[:-1])
    assert traj.num_turns == 3 and len(traj.routed_experts) == 3, (traj.finish_reason, tok.decode(traj.response_ids))
    whole = traj.prompt_ids + traj.response_ids
    assert torch.equal(ascending(traj.routing()), own_routing(model, whole)[:-1])


def test_a_trajectory_that_ends_on_an_observation_has_the_routing_of_every_position():
    """The first turn's invalid action gets the invalid-action message, cut to the 3 tokens the
    budget has left: the trajectory ends on it. Before the fix its routing stopped at the last
    generated token's predecessor, and the trainer's batch refused it (check_routing)."""
    from megarl.backends.batch import check_routing

    model = tiny_hf_model("qwen3_moe")
    tok = tiny_tokenizer()
    engine = LocalEngine(model, max_batch_size=2, eos_token_ids=[], record_routing=True, tokenizer=tok)
    prompt = prompts_of([11])[0]
    settings = AgentSettings(max_turns=2, max_turn_length=5, max_obs_length=8, max_response_length=5 + 3,
                             routed_experts=True)

    async def roll():
        try:
            return await run_trajectory(engine, tok, prompt, settings, tools=NoSearches(), seed=3)
        finally:
            await engine.close()

    traj = asyncio.run(roll())
    assert traj.finish_reason == "length" and list(traj.loss_mask) == [1] * 5 + [0] * 3  # ends on the observation
    whole = traj.prompt_ids + list(traj.response_ids)
    check_routing([traj.routing()], [len(whole)])
    assert torch.equal(ascending(traj.routing()), own_routing(model, whole)[:-1])


def test_an_engine_asked_for_routing_it_does_not_record_says_so():
    with pytest.raises(ValueError, match="record_routing"):
        LocalEngine(tiny_hf_model("qwen3"), record_routing=True)  # dense: nothing to record
    engine = LocalEngine(tiny_hf_model("qwen3_moe"), eos_token_ids=[])

    async def ask():
        try:
            await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2, routed_experts_from=0))
        finally:
            await engine.close()

    with pytest.raises(ValueError, match="does not record"):
        asyncio.run(ask())


def expert_by_hand(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    inter = experts.down_proj.shape[-1]
    gate, up = experts.gate_up_proj[e][:inter] @ x, experts.gate_up_proj[e][inter:] @ x
    return experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up)


def test_a_replayed_moe_block_uses_the_given_experts_weighted_by_their_probabilities():
    model = tiny_hf_model("qwen3_moe")
    block = model.model.layers[0].mlp
    x = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    chosen = torch.tensor([[0, 5], [3, 1], [2, 4], [5, 0], [1, 2]])
    other = [torch.zeros_like(chosen)] * 2  # the other MoE layers (not run here)
    with torch.no_grad(), replayed_routing(model, [chosen, *other]):
        got = block(x)[0]
    with torch.no_grad():
        for t in range(5):
            probs = torch.softmax(block.gate.weight @ x[0, t], dim=-1)[chosen[t]]
            weights = probs / probs.sum()  # norm_topk_prob
            want = sum(w * expert_by_hand(block.experts, int(e), x[0, t]) for w, e in zip(weights, chosen[t]))
            torch.testing.assert_close(got[t], want, atol=1e-5, rtol=0)


def test_replaying_the_models_own_routing_changes_nothing_and_another_routing_changes_the_log_probs():
    model = tiny_hf_model("qwen3_moe")
    ids = torch.tensor(prompts_of([12, 12], seed=5))
    mask = torch.ones_like(ids)
    own = torch.stack([own_routing(model, row.tolist()) for row in ids])  # (2, 12, 3 x k)
    with torch.no_grad():
        plain, _ = token_log_probs(model, ids, mask)
        with replayed_routing(model, replay_indices(own, TOPK, [0, 2, 3], 4)):
            same, _ = token_log_probs(model, ids, mask)
        with replayed_routing(model, replay_indices((own + 1) % 6, TOPK, [0, 2, 3], 4)):
            moved, _ = token_log_probs(model, ids, mask)
    torch.testing.assert_close(same, plain, atol=1e-6, rtol=0)
    assert (moved - plain)[:, 1:].abs().min() > 1e-4  # every token's log-prob moves


def test_replay_indices_by_hand():
    # two tokens, 2 MoE layers of top-2 among 3 layers (layer 1 dense); the second token has no routing
    routed = torch.tensor([[[4, 1, 0, 3], [-1, -1, -1, -1]]], dtype=torch.int16)
    first, second = replay_indices(routed, 2, [0, 2], 3)
    assert first.tolist() == [[4, 1], [0, 1]] and second.tolist() == [[0, 3], [0, 1]]
    # an engine reporting every layer: the dense layer's columns are skipped
    all_layers = torch.tensor([[[4, 1, 9, 9, 0, 3]]], dtype=torch.int16)
    assert [t.tolist() for t in replay_indices(all_layers, 2, [0, 2], 3)] == [[[4, 1]], [[0, 3]]]
    with pytest.raises(ValueError, match="width 5"):
        replay_indices(torch.zeros(1, 1, 5, dtype=torch.int16), 2, [0, 2], 3)


def test_a_batch_places_each_tokens_experts_and_refuses_a_sample_without_them():
    routed = [torch.tensor([[1, 2], [3, 4], [5, 0]], dtype=torch.int16), torch.tensor([[2, 3]], dtype=torch.int16)]
    batch = TrainBatch.from_sequences([[7, 8], [9]], [[1, 2], [3]], [[1, 1], [1]], routed_experts=routed)
    assert batch.routing().tolist() == [[[1, 2], [3, 4], [5, 0], [-1, -1]], [[2, 3], [-1, -1], [-1, -1], [-1, -1]]]
    assert batch.select(torch.tensor([1])).cut(2).routing().tolist() == [[[2, 3], [-1, -1]]]
    assert batch.select(slice(0, 1)).routing().tolist() == [[[1, 2], [3, 4], [5, 0], [-1, -1]]]
    assert [len(r) for r in batch.routed_experts.rows] == [3, 1]  # kept unpadded
    with pytest.raises(ValueError, match="missing for rows \\[1\\]"):
        TrainBatch.from_sequences([[7, 8], [9]], [[1, 2], [3]], [[1, 1], [1]], routed_experts=[routed[0], None])
    with pytest.raises(ValueError, match="row 0: routed experts for 2 positions, expected 3"):
        TrainBatch.from_sequences([[7, 8]], [[1, 2]], [[1, 1]], routed_experts=[routed[0][:2]])


def test_the_embedded_server_answers_routed_experts_as_sglang_does():
    import threading
    import time

    import uvicorn

    from megarl.rollout.http import HTTPEngine, create_engine_app
    from test_rollout_http import free_port

    model = tiny_hf_model("qwen3_moe")
    engine = LocalEngine(model, eos_token_ids=[], record_routing=True)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_engine_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    prompt = prompts_of([10])[0]

    async def ask():
        client = HTTPEngine(f"http://127.0.0.1:{port}")
        try:
            return await client.generate(prompt, SamplingParams(max_new_tokens=4, seed=1, routed_experts_from=7))
        finally:
            await client.close()

    try:
        out = asyncio.run(ask())
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    whole = prompt + out.token_ids
    assert out.routed_experts.shape == (len(whole) - 1 - 7, 3 * TOPK)
    assert torch.equal(ascending(out.routed_experts), own_routing(model, whole)[7:-1])


@pytest.mark.megatron
def test_a_routers_tokens_come_sequence_first_and_sequence_parallel_ranks_take_their_share():
    from megarl.backends.megatron.routing import routing_for_rank

    # 2 rows of 4 tokens, one MoE layer of top-1: token (b, s) routed to expert 10 * b + s
    routed = torch.tensor([[[0], [1], [2], [3]], [[10], [11], [12], [13]]], dtype=torch.int16)
    whole = routing_for_rank(routed, 1, [0], 1)[0]
    assert whole.flatten().tolist() == [0, 10, 1, 11, 2, 12, 3, 13]  # [S, B] flattened, as megatron's hidden states
    second_half = routing_for_rank(routed, 1, [0], 1, sequence_share=(1, 2))[0]
    assert second_half.flatten().tolist() == [2, 12, 3, 13]  # TP rank 1 of 2 holds positions 2 and 3
