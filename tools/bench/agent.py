"""Benchmark: megarl's independent trajectories vs a lockstep multi-turn loop.

Both loops drive the same embedded engine and model over the same Search-R1 trajectories:
the Search-R1 instruction as the prompt, 1 to 4 turns each, every turn but the last ending in a
search, answered by megarl's retrieval server (a BM25 index of the bench's corpus, served over
HTTP in its own process, as a run serves it), the last in an answer. Turn lengths are drawn per
turn from a long-tailed (log-normal) distribution, as reasoning lengths are in real runs, and
there are more trajectories than engine slots. The lockstep loop is the shape of Search-R1's
rollout: every turn, all trajectories still going generate, the batch waits for the slowest,
searches as one batch, and each turn's whole history is sent again. megarl's loop runs every
trajectory as its own task, so one that is between turns never waits for the others.

The headline baseline is the lockstep loop with the same prefix reuse as megarl's (the engine
keeps the cache of every trajectory's previous turn and computes the shared instruction once,
as SGLang's radix cache and vLLM's prefix cache do by default): the ratio measures the loop, not
the cache. Search-R1's own lockstep loop without a cache is the second row.

The model is a random tiny Qwen2, so it cannot choose its actions: `ScriptedPolicy` stands in
for a trained one. It lets the model sample each turn's drawn number of tokens, then appends the
action a trained policy would end the turn with (`<search> ... </search>`, or `<answer> ...
</answer>` on the last turn), with log-prob 0. Every loop gets the same turns, the same
searches and the same number of tokens (checked by the bench protocol, protocol.py: a warm-up,
3 alternating timed runs, the median ratio last).

    python tools/bench/agent.py [--trajectories 128 --max-batch-size 64 --median-turn-length 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megarl.data.tokenizer import train_bpe_tokenizer
from megarl.http_auth import RETRIEVAL_KEY_ENV
from megarl.retrieval.client import RetrievalClient, SearchResult
from megarl.retrieval.documents import Document
from megarl.tools.search import SEARCH_TOOLS
from megarl.rollout.agent import (INVALID_ACTION_MESSAGE, SEARCH_INSTRUCTION,
                                  AgentSettings, Trajectory, build_search_prompt, format_observation,
                                  run_trajectory)
from megarl.rollout.engine import GenerationOutput, SamplingParams
from megarl.rollout.local import LocalEngine
from megarl.rollout.sglang_launch import ServerProcess
from megarl.versions import installed_versions
from protocol import compare

WORDS = ("river harbour council founded merchant guild charter bridge fortress abbey market tower wall "
         "province governor treaty archive census canal mill quarry cathedral bishop duke railway").split()


def question(i: int) -> str:
    return f"who founded the city of {i * 7}?"


def passage(i: int, k: int) -> Document:
    """A ~100-word passage, as the wiki-18 corpus holds them."""
    rng = random.Random(i * 31 + k)
    text = " ".join(rng.choice(WORDS) for _ in range(100))
    return Document(id=f"{i}-{k}", contents=f'"City {i * 7} ({k})"\n{text}')


class RetrievalServer:
    """`megarl retrieval serve` in its own process over a BM25 index of the bench's corpus: the
    passages of every question's city, and `distractors` more about other cities."""

    KEY = "agent-bench-retrieval"

    def __init__(self, workdir: Path, questions: int, distractors: int):
        from megarl.retrieval import build_index

        corpus = workdir / "corpus.jsonl"
        with open(corpus, "w") as f:
            for i in range(questions + distractors // 3):
                f.writelines(json.dumps(passage(i, k).to_dict()) + "\n" for k in range(3))
        index = build_index(corpus, workdir / "index", show_progress=False, checksum=False)
        # started, health-checked and stopped as the fleet does its servers (a deadline, a log)
        self.server = ServerProcess([sys.executable, "-m", "megarl.cli", "retrieval", "serve", "--index", str(index)],
                                    "retrieval", log_dir=str(workdir), env={RETRIEVAL_KEY_ENV: self.KEY})
        self.url = self.server.start(timeout_s=120)

    def close(self) -> None:
        self.server.stop()


class CountingSearcher:
    """The retrieval client, counting the queries it is sent."""

    def __init__(self, url: str):
        self.client, self.queries = RetrievalClient(url, api_key=RetrievalServer.KEY, timeout_s=60), 0

    async def search(self, queries, topk=3):
        self.queries += len(queries)
        return await self.client.search(queries, topk)


class ScriptedPolicy:
    """The engine as the loops see it: the model samples `lengths[i][t]` tokens for turn t of
    trajectory i, then the turn's action is appended (see the module docstring)."""

    def __init__(self, engine, tokenizer, prompts, lengths):
        self.engine, self.lengths = engine, lengths
        self.index = {tuple(p): i for i, p in enumerate(prompts)}
        self.prompt_sizes = sorted({len(p) for p in prompts})
        self.turn = [0] * len(prompts)
        self.search = [tokenizer.encode(f" <search> {question(i)} </search>", add_special_tokens=False)
                       for i in range(len(prompts))]
        self.answer = tokenizer.encode(" <answer> the founders </answer>", add_special_tokens=False)

    async def generate(self, prompt_ids, params: SamplingParams) -> GenerationOutput:
        i = next(self.index[k] for n in self.prompt_sizes if (k := tuple(prompt_ids[:n])) in self.index)
        turn, self.turn[i] = self.turn[i], self.turn[i] + 1
        # the model's own stop strings would end a turn at random: the script decides instead
        out = await self.engine.generate(prompt_ids, replace(params, max_new_tokens=self.lengths[i][turn], stop=()))
        final = turn == len(self.lengths[i]) - 1
        action = self.answer if final else self.search[i]
        return replace(out, token_ids=out.token_ids + action, log_probs=out.log_probs + [0.0] * len(action),
                       token_versions=out.versions() + [out.weight_version] * len(action), finish_reason="stop",
                       matched_stop="</answer>" if final else "</search>")


def trajectories(n: int, median: int, sigma: float, max_turn_length: int, seed: int):
    """Per trajectory: its settings and its turn lengths (1 to 4 turns; trajectory 0 has 4)."""
    rng = random.Random(seed)
    settings, lengths = [], []
    for i in range(n):
        turns = rng.randint(0, 3) if i else 3
        lengths.append([min(max_turn_length, max(8, round(median * math.exp(sigma * rng.gauss(0, 1)))))
                        for _ in range(turns + 1)])
        # max_turns=0 would be the single-turn path: every trajectory here is a search agent's
        settings.append(AgentSettings(max_turns=max(turns, 1), max_turn_length=max_turn_length + 32,
                                      max_obs_length=500, max_response_length=1 << 16, topk=3))
    return settings, lengths


async def independent(engine, tok, prompts, settings, searcher) -> list[Trajectory]:
    return await asyncio.gather(*[run_trajectory(engine, tok, p, s, tools=searcher, seed=i)
                                  for i, (p, s) in enumerate(zip(prompts, settings))])


async def lockstep(engine, tok, prompts, settings, searcher) -> list[Trajectory]:
    """Search-R1's loop: a turn for every trajectory still going, then one batch of searches."""
    trajs = [Trajectory(prompt_ids=list(p)) for p in prompts]
    active = list(range(len(prompts)))
    for turn in range(max(s.max_turns for s in settings) + 1):
        outs = await asyncio.gather(*[engine.generate(
            trajs[i].prompt_ids + trajs[i].response_ids,
            SamplingParams(max_new_tokens=settings[i].max_turn_length, temperature=1.0, seed=i + turn,
                           stop=SEARCH_TOOLS.stop_strings(final=turn == settings[i].max_turns)))
            for i in active])  # the whole batch waits here for its slowest member
        searching = []
        for i, out in zip(active, outs):
            trajs[i].extend(out.token_ids, out.log_probs)
            trajs[i].num_turns += 1
            action = SEARCH_TOOLS.parse(tok.decode(out.token_ids))
            if action.kind == "call" and turn < settings[i].max_turns:
                searching.append((i, action.arguments["query"]))
            elif action.kind != "answer" and turn < settings[i].max_turns:
                trajs[i].extend(tok.encode(INVALID_ACTION_MESSAGE, add_special_tokens=False), None)
        results = await searcher.search([q for _, q in searching], topk=3) if searching else []
        for (i, _), result in zip(searching, results):
            observation = tok.encode(format_observation(result), add_special_tokens=False)
            trajs[i].extend(observation[: settings[i].max_obs_length], None)
        active = [i for i, _ in searching]
    return trajs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=128)
    parser.add_argument("--distractors", type=int, default=30000, help="passages about no question's city")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (alternating), after a warm-up")
    parser.add_argument("--median-turn-length", type=int, default=32, help="median tokens the model samples per turn")
    parser.add_argument("--sigma", type=float, default=0.9, help="spread of log(turn length); larger = longer tail")
    parser.add_argument("--max-turn-length", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=64,
                        help="engine slots (a GPU engine holds a batch like this one at once; fewer slots than "
                             "trajectories make both loops queue)")
    args = parser.parse_args()
    print(installed_versions(), flush=True)  # first: the tokenizer and the index are built before the runs
    texts = [SEARCH_INSTRUCTION.format(question=question(i)) for i in range(200)]
    texts += [format_observation(SearchResult(docs=[passage(i, k) for k in range(3)])) for i in range(20)]
    tok = train_bpe_tokenizer(texts + [INVALID_ACTION_MESSAGE], 1000)
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(args.hidden // 128, 1),
        max_position_embeddings=8192)).eval()
    prompts = [build_search_prompt(tok, question(i)) for i in range(args.trajectories)]
    settings, lengths = trajectories(args.trajectories, args.median_turn_length, args.sigma, args.max_turn_length,
                                     args.seed)
    turns = [len(t) for t in lengths]
    observation = len(tok.encode(format_observation(SearchResult(docs=[passage(0, k) for k in range(3)])),
                                 add_special_tokens=False))
    searches = sum(turns) - len(turns)
    header = (f"{args.trajectories} trajectories, turns per trajectory: "
          + ", ".join(f"{k}: {turns.count(k)}" for k in range(1, 5))
          + f"; sampled tokens per turn {min(map(min, lengths))}-{max(map(max, lengths))} "
          + f"(median {args.median_turn_length}); prompt {len(prompts[0])} tokens, observation {observation} tokens; "
          + f"engine slots {args.max_batch_size}; retrieval: megarl's BM25 server over HTTP, "
          + f"{3 * (args.trajectories + args.distractors // 3):,} passages\n"
          + f"longest trajectory {max(map(sum, lengths))} sampled tokens, sum over turns of the longest turn "
          + f"{sum(max(t[k] for t in lengths if len(t) > k) for k in range(max(turns)))}")

    def contender(loop, kept: int):
        def run() -> float:
            async def go():
                engine = LocalEngine(model, tok, max_batch_size=args.max_batch_size, eos_token_ids=[],
                                     kept_sequences=kept)
                policy, searcher = ScriptedPolicy(engine, tok, prompts, lengths), CountingSearcher(server.url)
                try:
                    trajs = await loop(policy, tok, prompts, settings, searcher)
                finally:
                    await searcher.client.aclose()
                    await engine.close()
                assert [t.num_turns for t in trajs] == turns, "every loop must run the same turns"
                assert searches == sum(turns) - len(turns), "every turn but the last searches"
                assert all(t.num_turns == 1 or any(not m for m in t.loss_mask) for t in trajs), "observations"
                return sum(sum(t.loss_mask) for t in trajs)  # the model's tokens (actions included)
            return asyncio.run(go())
        return run

    # the cache keeps every trajectory's last turn in both loops (kept_sequences), as a radix
    # cache with room for them does; kept_sequences=0 is no cache at all
    contenders = {"lockstep": contender(lockstep, args.trajectories), "megarl": contender(independent,
                                                                                          args.trajectories),
                  "lockstep, no cache": contender(lockstep, 0)}
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as workdir:
        server = RetrievalServer(Path(workdir), args.trajectories, args.distractors)
        try:
            result = compare(contenders, repeats=args.repeats, versions=False, header=header,
                             show=lambda line: print(line, flush=True))
        finally:
            server.close()
    for name in contenders:
        print(f"{name}: trajectories/s " + ", ".join(f"{len(prompts) / s:.2f}" for s in result.seconds[name]))
    print(result.summary("lockstep, no cache", "megarl") + " (Search-R1's loop without a prefix cache)")
    print(result.summary("lockstep", "megarl") + " (the lockstep loop with the same prefix reuse; target >= 1.3x)")

if __name__ == "__main__":
    main()
