"""Benchmark: one driver feeding 64 engines. megarl's own fleet client (`SGLangFleet` through
sglang-router 0.3.2, cache-aware routing as the product configures it) and agent loop
(`run_trajectories`, the Search-R1 loop) drive 8,000 trajectories of 1-4 turns against 64
simulated SGLang engines, each an H100 pair (the 32B recipe's engine TP 2) serving Qwen2.5-32B.

The engines (tools/bench/fleet_engines.py) run in one process of their own, continuous batching
in simulated GPU time from the planner's figures (`megarl plan`'s decode step; prefill at its
forward efficiency); the model's turns are scripted from the run's seed (1-4 turns, lengths
log-normal, median 150 tokens, at most the recipe's 500 a turn with the action; every turn but
the last ends in a search, the last in an answer). Searches go to megarl's retrieval server
(`megarl retrieval serve`, BM25 over the bench's corpus, its own process, over HTTP), each
after `--search-latency` seconds of simulated latency (a dense retriever's tens of ms), slept
in the bench's searcher before the real call.

The figure: **utilisation vs ideal = ideal time / wall time**. The wall time runs from the first
request to the last answer. The ideal time is the same work with a driver that costs nothing: a
replay, in simulated time (an event loop whose clock jumps to its next timer), of every turn the
engines served, each on the engine that served it (the router's choice), with the same
continuous batching, prompts and lengths: every trajectory starts at 0, each turn is sent the
moment the previous one ends (plus the search latency), nothing else waits. What the replay
keeps idle (a trajectory waiting for its search, the tail when few trajectories remain) is the
ideal's; what the run adds (the driver's HTTP, JSON, tokenizer and loop time, the router's and the
real retrieval call's time, the engine process's lateness) is the system's. A ratio of 1 means
the engines were kept as busy as a free driver could keep them. The engines' busy fraction
(GPU time with a step running over wall time) is printed for both, as context.

That ideal keeps the router's choices, so it cannot show bad routing. A second ideal is printed
beside it: the same replay with each turn sent, when it arrives, to the engine with the fewest
tokens still to compute once it is added (waiting prefill and new tokens, running requests'
new tokens not yet decoded, and this turn's prefill on that engine, so a trajectory's cache
counts), chosen from the replay's own state and not from what the router did. The run's wall
time is printed against it too, and the router's replay against it: above 100% the router's
choices cost time a least-loaded router would not have spent.

Time scale: the default runs in simulated GPU time as is (`--time-scale 1`): 8,000
trajectories all start at once, so the run lasts about as long as the longest trajectory's
turns (a few minutes with start-up). `--time-scale s` multiplies every simulated GPU time and
the search latency by s: below 1 the same requests come s times faster, so the driver must keep
up with 1/s times the requests per second. A smaller scale makes the target harder, never
easier; the test's small run uses 0.1.

    python tools/bench/fleet_scale.py [--engines 64 --trajectories 8000 --seed 0 --time-scale 1]

Prints the versions first, the figures, then the target last; exits 1 when it is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import selectors
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from agent import WORDS, CountingSearcher, RetrievalServer, passage, question
from fleet_engines import SEED_STRIDE, LatencyModel, SimEngine, turn_lengths
from megarl.config import SGLangConfig
from megarl.data.tokenizer import train_bpe_tokenizer
from megarl.http_auth import bearer
from megarl.retrieval.client import SearchResult
from megarl.rollout.agent import (INVALID_ACTION_MESSAGE, SEARCH_INSTRUCTION, AgentSettings, build_search_prompt,
                                  format_observation, run_trajectories)
from megarl.rollout.sglang import SGLangFleet
from megarl.rollout.sglang_launch import ServerProcess, free_port, router_command
from megarl.versions import installed_versions

ENGINES_SCRIPT = Path(__file__).resolve().parent / "fleet_engines.py"
KEY = "fleet-bench-engines"
TARGET = 0.90  # of the ideal
# the Search-R1 32B recipe's agent settings (examples/search_r1/search_r1_qwen2.5_32b.yaml)
SETTINGS = AgentSettings(max_turns=4, max_turn_length=500, max_obs_length=500, max_response_length=4096, topk=3)


class DelayedSearcher(CountingSearcher):
    """The retrieval client, each call after `latency_s` of simulated latency (module docstring)."""

    def __init__(self, url: str, latency_s: float):
        super().__init__(url)
        self.latency_s = latency_s

    async def search(self, queries, topk=3):
        await asyncio.sleep(self.latency_s)
        return await super().search(queries, topk)


def build_tokenizer():
    texts = [SEARCH_INSTRUCTION.format(question=question(i)) for i in range(200)]
    texts += [format_observation(SearchResult(docs=[passage(i, k) for k in range(3)])) for i in range(20)]
    return train_bpe_tokenizer(texts + [INVALID_ACTION_MESSAGE], 1000)


def write_script(tok, trajectories: int, args, path: Path) -> int:
    """The engines' script (fleet_engines.Script); returns the longest a turn's sampled part may be."""
    filler = tok.encode(" " + " ".join(WORDS * 3), add_special_tokens=False)
    searches = [tok.encode(f" <search> {question(i)} </search>", add_special_tokens=False) for i in range(trajectories)]
    answer = tok.encode(" <answer> the founders </answer>", add_special_tokens=False)
    longest = SETTINGS.max_turn_length - max(map(len, searches + [answer]))
    used = set(filler) | set(answer) | {t for s in searches for t in s}
    path.write_text(json.dumps({"seed": args.seed, "median": args.median_turn_length, "sigma": args.sigma,
                                "longest": longest, "filler": filler, "searches": searches, "answer": answer,
                                "text": {t: tok.decode([t]) for t in used}}))
    return longest


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to its next timer instead of waiting for it: coroutines
    that only sleep run in simulated time, as fast as the CPU runs them."""

    def __init__(self):
        self.now = 0.0
        loop = self

        class Instant(selectors.DefaultSelector):
            def select(self, timeout=None):
                ready = super().select(0)
                if not ready and timeout is None:
                    raise RuntimeError("the simulation waits for nothing that will happen")
                if not ready and timeout:
                    loop.now += timeout
                return ready

        super().__init__(Instant())

    def time(self) -> float:
        return self.now


def ideal(served: list[list], model: LatencyModel, search_latency_s: float,
          least_loaded: bool = False) -> tuple[float, list[float]]:
    """(seconds, each engine's busy seconds) of the replay the module docstring defines;
    `served[e]`: engine e's (trajectory, turn, input tokens, new tokens, max_new_tokens). With
    `least_loaded`, each turn goes to the engine with the fewest tokens still to compute once it
    is added (its prefill there counted: the engine holding the trajectory's cache prefills
    less), not to the engine that served it."""
    turns: dict[int, list] = {}
    for e, records in enumerate(served):
        for key, turn, *sizes in records:
            if key is not None:  # not a health check
                turns.setdefault(key, []).append((turn, e, *sizes[:3]))

    async def replay():
        engines = [SimEngine(model) for _ in served]
        tasks = [asyncio.ensure_future(e.run()) for e in engines]

        def least_loaded_engine(key, input_len):
            return min(range(len(engines)),
                       key=lambda i: engines[i].outstanding() + engines[i].uncached(key, input_len))

        async def trajectory(key, steps):
            for i, (turn, e, *sizes) in enumerate(sorted(steps)):
                if i:
                    await asyncio.sleep(search_latency_s)
                if least_loaded:
                    e = least_loaded_engine(key, sizes[0])
                await engines[e].generate(key, turn, *sizes)
        await asyncio.gather(*[trajectory(k, s) for k, s in turns.items()])
        end = asyncio.get_running_loop().time()
        for t in tasks:
            t.cancel()
        return end, [e.busy_s for e in engines]

    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(replay())
    finally:
        loop.close()


def cpu_seconds(process: ServerProcess) -> float:
    """CPU time of a server's process and its children so far."""
    p = psutil.Process(process.pid())
    return sum(sum(q.cpu_times()[:2]) for q in [p, *p.children(recursive=True)])


async def drive(engines: ServerProcess, urls: list[str], router_url: str, tok, prompts, searcher) -> dict:
    fleet = SGLangFleet([(f"engine{i}", None, url, 2) for i, url in enumerate(urls)], SGLangConfig(),
                        router=(None, router_url), api_key=KEY)
    try:
        start, cpu = time.monotonic(), time.process_time()
        trajs = await run_trajectories(fleet, tok, prompts, SETTINGS, searcher,
                                       seeds=[SEED_STRIDE * i for i in range(len(prompts))])
        wall, cpu = time.monotonic() - start, time.process_time() - cpu
    finally:
        await fleet.close()
        await searcher.client.aclose()
    async with httpx.AsyncClient(headers=bearer(KEY), timeout=60) as client:
        stats = (await client.get(urls[0] + "/fleet_stats")).json()
    return {"trajs": trajs, "wall": wall, "cpu": cpu, "stats": stats, "start": start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--trajectories", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiplies every simulated GPU time and the "
                        "search latency (module docstring)")
    parser.add_argument("--search-latency", type=float, default=0.03, help="simulated seconds a search takes")
    parser.add_argument("--median-turn-length", type=float, default=150, help="median tokens sampled per turn")
    parser.add_argument("--sigma", type=float, default=0.8, help="spread of log(turn length)")
    parser.add_argument("--distractors", type=int, default=30000, help="passages about no question's city")
    args = parser.parse_args()
    print(installed_versions(), flush=True)
    tok = build_tokenizer()
    prompts = [build_search_prompt(tok, question(i)) for i in range(args.trajectories)]
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as workdir:
        work = Path(workdir)
        longest = write_script(tok, args.trajectories, args, work / "script.json")
        tok.save_pretrained(work / "model")
        retrieval = RetrievalServer(work, args.trajectories, args.distractors)
        servers = [retrieval.server]
        try:
            engines = ServerProcess([sys.executable, str(ENGINES_SCRIPT), "--script", str(work / "script.json"),
                                     "--engines", str(args.engines), "--ports-file", str(work / "ports.json"),
                                     "--time-scale", str(args.time_scale), "--model-path", str(work / "model")],
                                    "engines", log_dir=workdir, api_key=KEY)
            engines.start(timeout_s=120)
            servers.append(engines)
            urls = [f"http://127.0.0.1:{p}" for p in json.loads((work / "ports.json").read_text())]
            router = ServerProcess(router_command(SGLangConfig(), urls, free_port()), "router", log_dir=workdir,
                                   api_key=KEY)
            router_url = router.start(timeout_s=120)
            servers.append(router)
            before = {s.name: cpu_seconds(s) for s in servers}
            searcher = DelayedSearcher(retrieval.url, args.search_latency * args.time_scale)
            run = asyncio.run(drive(engines, urls, router_url, tok, prompts, searcher))
            used = {s.name: cpu_seconds(s) - before[s.name] for s in servers}
        finally:
            for s in reversed(servers):
                s.stop()
    report(args, run, used, longest, searcher)


def waits(engines: list[dict], start: float, search_latency_s: float) -> str:
    """Where the engines waited for the rest of the system: when the first turns reached them, and
    the time from a turn's end at its engine to the next turn's arrival, less the search latency."""
    first, between = [], []
    ends = {}
    for e in engines:
        for key, turn, *_, arrived, ended in e["records"]:
            if key is not None:
                ends[key, turn] = (arrived, ended)
    for (key, turn), (arrived, _) in ends.items():
        if turn == 0:
            first.append(arrived - start)
        elif (key, turn - 1) in ends:
            between.append(arrived - ends[key, turn - 1][1] - search_latency_s)
    first.sort(), between.sort()
    q = lambda xs, f: xs[min(int(f * len(xs)), len(xs) - 1)] if xs else float("nan")  # noqa: E731
    return (f"first turns reached the engines {q(first, 0.5):.2f} s (median) / {q(first, 1):.2f} s (last) after the "
            f"start; between turns, beyond the search latency: median {q(between, 0.5) * 1000:.0f} ms, 90th percentile "
            f"{q(between, 0.9) * 1000:.0f} ms, max {q(between, 1) * 1000:.0f} ms")


def report(args, run: dict, used: dict, longest: int, searcher: DelayedSearcher) -> None:
    trajs, stats, n = run["trajs"], run["stats"], args.trajectories
    model = LatencyModel.of(time_scale=args.time_scale)
    ideal_s, ideal_busy = ideal([e["records"] for e in stats["engines"]], model, args.search_latency * args.time_scale)
    drawn = [turn_lengths(args.seed, i, args.median_turn_length, args.sigma, longest) for i in range(n)]
    turns = sum(t.num_turns for t in trajs)
    generated = sum(sum(t.loss_mask) for t in trajs)
    busy = [e["busy_s"] for e in stats["engines"]]
    print(f"{n} trajectories on {args.engines} engines (time scale {args.time_scale:g}): turns {turns} "
          f"(per trajectory " + ", ".join(f"{k}: {sum(len(d) == k for d in drawn)}" for k in range(1, 5)) + "), "
          f"searches {searcher.queries} in {searcher.client.stats.requests} requests to the retrieval server "
          f"({searcher.client.stats.retries} retries), answered {sum(t.finish_reason == 'answer' for t in trajs)}/{n}")
    print(f"tokens generated {generated:,} ({sum(map(sum, drawn)):,} sampled + {generated - sum(map(sum, drawn)):,} "
          f"of actions), observation tokens {sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajs):,}, "
          f"requests served {sum(len(e['records']) for e in stats['engines']):,}")
    if stats["unknown"]:
        print(f"routes the simulated engines do not serve were called: {stats['unknown']}")
    print(f"wall time {run['wall']:.1f} s, ideal time {ideal_s:.1f} s; engines busy {sum(busy) / len(busy) / run['wall']:.1%} "
          f"of the wall time (ideal: {sum(ideal_busy) / len(ideal_busy) / ideal_s:.1%})")
    print(f"CPU seconds: driver {run['cpu']:.1f} ({run['cpu'] / n * 1000:.2f} ms a trajectory, "
          f"{run['cpu'] / run['wall']:.0%} of a core), router {used['router']:.1f}, engines process "
          f"{used['engines']:.1f}, retrieval server {used['retrieval']:.1f}")
    print(waits(stats["engines"], run["start"], args.search_latency * args.time_scale))
    balanced_s, balanced_busy = ideal([e["records"] for e in stats["engines"]], model,
                                      args.search_latency * args.time_scale, least_loaded=True)
    print(f"least-loaded ideal time {balanced_s:.1f} s (engines busy {sum(balanced_busy) / len(balanced_busy) / balanced_s:.1%}): "
          f"the router's choices replayed take {ideal_s / balanced_s:.1%} of it; utilisation vs the least-loaded "
          f"ideal {balanced_s / run['wall']:.1%}")
    ratio = ideal_s / run["wall"]
    met = ratio >= TARGET
    print(f"target utilisation vs ideal >= {TARGET:.0%}: {ratio:.1%} ({'met' if met else 'MISSED'})")
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
