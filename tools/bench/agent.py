"""Benchmark: megarl's independent trajectories vs a lockstep multi-turn loop.

Both drive the same embedded engine and model over the same trajectories: a mix of 1 to 4
turns each, with turn lengths that differ between trajectories (as real responses do). The
lockstep loop is the shape of Search-R1's original rollout: every turn, all trajectories
still going generate, and the batch waits for the slowest before anyone gets an
observation, and prefills each turn's whole history again. megarl's loop runs every
trajectory as its own task, so one that is done (or between turns) never waits for the
others, and its engine reuses the cache of a trajectory's previous turn (measured without
that reuse too). The model is a random tiny Qwen2, so no turn
contains a valid action: each turn gets the invalid-action observation, which makes the
turn count of each trajectory exactly its max_turns + 1 in both loops.

    python tools/bench/agent.py [--trajectories 64 --max-turn-length 96]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megarl.data.tokenizer import train_bpe_tokenizer
from megarl.rollout.agent import (ANSWER_CLOSE, INVALID_ACTION_MESSAGE, SEARCH_CLOSE, AgentSettings, Trajectory,
                                  run_trajectory)
from megarl.rollout.engine import SamplingParams
from megarl.rollout.local import LocalEngine
from megarl.versions import installed_versions


def trajectory_settings(n: int, max_turn_length: int, seed: int) -> list[AgentSettings]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns, length = rng.randint(0, 3) if i else 3, rng.randint(max_turn_length // 6, max_turn_length)
        # max_turns=0 is the single-turn path, whose one turn may use the whole response
        # budget: cap that budget at the turn length so that both loops do the same work
        out.append(AgentSettings(max_turns=turns, max_turn_length=length, max_obs_length=64,
                                 max_response_length=length if turns == 0 else 8192, topk=3))
    return out


async def independent(engine, tok, prompts, settings) -> list[Trajectory]:
    # max_turns=0 would mean the single-turn path; the bench wants "1 turn of a search agent",
    # so each trajectory runs with its own settings through run_trajectory (searcher unused)
    return await asyncio.gather(*[run_trajectory(engine, tok, p, s, searcher=_NoSearch(), seed=i)
                                  for i, (p, s) in enumerate(zip(prompts, settings))])


async def lockstep(engine, tok, prompts, settings) -> list[Trajectory]:
    trajs = [Trajectory(prompt_ids=list(p)) for p in prompts]
    message = tok.encode(INVALID_ACTION_MESSAGE, add_special_tokens=False)
    for turn in range(max(s.max_turns for s in settings) + 1):
        active = [i for i, s in enumerate(settings) if turn <= s.max_turns]
        outs = await asyncio.gather(*[engine.generate(
            trajs[i].prompt_ids + trajs[i].response_ids,
            SamplingParams(max_new_tokens=settings[i].max_turn_length, temperature=1.0, seed=i + turn,
                           stop=_stops(turn, settings[i].max_turns)))
            for i in active])  # the whole batch waits here for its slowest member
        for i, out in zip(active, outs):
            trajs[i].extend(out.token_ids, out.log_probs)
            trajs[i].num_turns += 1
            if turn < settings[i].max_turns:
                trajs[i].extend(message, None)
    return trajs


def _stops(turn: int, max_turns: int) -> tuple[str, ...]:
    if max_turns == 0:
        return ()  # single turn: generation ends at EOS or the budget, as in run_trajectory
    return (SEARCH_CLOSE, ANSWER_CLOSE) if turn < max_turns else (ANSWER_CLOSE,)


class _NoSearch:
    async def search(self, queries, topk=3):
        raise AssertionError("the random model never emits a valid search")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--max-turn-length", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=16,
                        help="engine slots (a GPU engine's KV memory bounds them; here fewer slots than trajectories)")
    args = parser.parse_args()
    print(installed_versions(), flush=True)
    tok = train_bpe_tokenizer([f"question {i}: who founded the city of {i * 7}?" for i in range(200)], 1000)
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(args.hidden // 128, 1),
        max_position_embeddings=8192)).eval()
    prompts = [tok.encode(f"question {i}: who founded the city of {i * 7}?") for i in range(args.trajectories)]
    settings = trajectory_settings(args.trajectories, args.max_turn_length, args.seed)
    turns = [s.max_turns + 1 for s in settings]
    print(f"{args.trajectories} trajectories, turns per trajectory: "
          + ", ".join(f"{k}: {turns.count(k)}" for k in range(1, 5))
          + f"; turn lengths {min(s.max_turn_length for s in settings)}-{args.max_turn_length} tokens"
          + f"; engine slots {args.max_batch_size}")

    results = {}
    # the lockstep baseline prefills each turn's whole history again, as Search-R1's loop does
    # without a prefix cache; megarl's loop is measured without and with the engine's prefix reuse
    for name, loop, kept in (("lockstep", lockstep, 0), ("megarl, no reuse", independent, 0),
                             ("megarl", independent, None)):
        async def go(loop=loop, kept=kept):
            engine = LocalEngine(model, tok, max_batch_size=args.max_batch_size, eos_token_ids=[],
                                 kept_sequences=kept)
            start = time.perf_counter()
            trajs = await loop(engine, tok, prompts, settings)
            elapsed = time.perf_counter() - start
            await engine.close()
            return elapsed, trajs
        elapsed, trajs = asyncio.run(go())
        assert [t.num_turns for t in trajs] == turns, "both loops must run the same turns"
        model_tokens = sum(sum(t.loss_mask) for t in trajs)
        results.setdefault("tokens", model_tokens)
        assert model_tokens == results["tokens"], "both loops must generate the same number of tokens"
        results[name] = elapsed
        print(f"{name:17} {elapsed:7.2f} s  {len(trajs) / elapsed:7.2f} trajectories/s  "
              f"{model_tokens / elapsed:8.1f} model tokens/s")
    print(f"ratio megarl / lockstep: {results['lockstep'] / results['megarl']:.2f}x")


if __name__ == "__main__":
    main()
