"""Reward throughput: serial scoring vs megarl.reward.RewardPool on synthetic responses.

    python tools/bench/rewards.py [--n 10000] [--workers N] [--math-verify-n 1000]

Builds n synthetic responses (correct, wrong and malformed) for DAPO math and for
Search-R1 exact match, plus a smaller math-verify set (its sympy work is ~1000× heavier
per sample, the case the pool is for), and scores them serially in this process and in a
pool started once per reward (its start-up timed apart and printed), under the bench
protocol (protocol.py): a warm-up of each, then --repeats (>= 3) timed runs with the two
alternated, equal work (responses scored) checked. Every run scores a fresh set of
responses, so that no run is sped up by caches (sympy's) warmed on the same ones; the two
contenders of a run score the same set, and their results must be identical (exit 1 if
not). Prints the median samples/s of each, then for each reward the median pool/serial
ratio and its range, dapo_math's last.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megarl.reward import RewardConfig, RewardPool, RewardRequest
from megarl.versions import installed_versions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from protocol import Comparison, compare  # noqa: E402

WORDS = "so we add the two terms then divide both sides by three and check the result again".split()


def filler(rng: random.Random, min_words: int, max_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))


def dapo_requests(n: int, rng: random.Random) -> list[RewardRequest]:
    """Reasoning of 100–800 words, then a final line that is right, wrong, a LaTeX
    variant of the right answer, or missing / cut off."""
    requests = []
    for i in range(n):
        answer = rng.randint(1, 100_000)
        final_line = rng.choice([
            f"Answer: {answer}",
            f"Answer: {answer + 1}",
            f"Answer: $\\boxed{{{answer}}}$",
            f"Answer: {answer:,}",
            f"Answer: x = {answer} \\text{{ dollars}}.",
            "I am not sure.",
            "Answer:",
        ])
        response = filler(rng, 100, 800) + "\n" + final_line
        requests.append(RewardRequest("math_dapo", response, str(answer), group_id=i // 16))
    return requests


def search_r1_requests(n: int, rng: random.Random) -> list[RewardRequest]:
    """0–3 search rounds with three retrieved documents each, then an answer that is
    right, wrong, missing, unclosed or nested."""
    cities = ["Paris", "Lyon", "Zürich", "東京", "New York", "the Hague"]
    requests = []
    for i in range(n):
        gold = rng.choice(cities)
        parts = [f"<think>{filler(rng, 10, 60)}</think>"]
        for _ in range(rng.randint(0, 3)):
            documents = " ".join(
                f'Doc {k}(Title: "{rng.choice(cities)}") {filler(rng, 40, 100)}' for k in range(1, 4)
            )
            parts.append(f"<search>{filler(rng, 3, 8)}</search>\n<information>{documents}</information>\n")
            parts.append(f"<think>{filler(rng, 10, 60)}</think>")
        parts.append(rng.choice([
            f"<answer>{gold}</answer>",
            f"<answer>{rng.choice(cities)}</answer>",
            "",
            f"<answer>{gold}",
            f"<answer>x<answer>{gold}</answer></answer>",
        ]))
        data_source = rng.choice(["nq", "hotpotqa", "triviaqa", "musique"])
        requests.append(RewardRequest(data_source, "".join(parts), {"target": [gold]}, group_id=i // 5))
    return requests


def math_verify_requests(n: int, rng: random.Random) -> list[RewardRequest]:
    requests = []
    for _ in range(n):
        p, q = rng.randint(1, 50), rng.randint(2, 50)
        boxed = rng.choice([f"\\frac{{{p}}}{{{q}}}", f"\\frac{{{2 * p}}}{{{2 * q}}}", f"{p / q:.6f}", f"{p + 1}/{q}"])
        response = filler(rng, 50, 300) + f" The final answer is $\\boxed{{{boxed}}}$."
        requests.append(RewardRequest("math", response, f"\\frac{{{p}}}{{{q}}}"))
    return requests


@dataclass
class Row:
    name: str
    n: int
    serial_per_s: float
    pool_start_s: float
    pool_per_s: float
    identical: bool


def measure(name: str, spec: RewardConfig, request_sets: list[list[RewardRequest]], workers: int,
            timeout_s: float, repeats: int) -> tuple[Row, Comparison]:
    """Serial scoring against a started pool under the bench protocol. The k-th call of each
    contender scores request_sets[k] (call 0 is the warm-up): each run a fresh set, so that no
    run is sped up by caches (sympy's) warmed on the same responses, and the same set for the
    two contenders of a repeat, whose results must be identical."""
    results: dict[str, list] = {"serial": [], "pool": []}  # per call, in call order
    failures = 0

    def scorer(contender: str, scoring: RewardPool):
        def run() -> int:
            nonlocal failures
            requests = request_sets[len(results[contender])]
            scored, stats = scoring.compute(requests)
            results[contender].append(scored)
            if contender == "pool":
                failures += stats.num_timeouts + stats.num_errors
            return len(requests)  # the work: requests scored
        return run

    with RewardPool(spec, num_workers=0, timeout_s=timeout_s) as serial:
        started = time.perf_counter()
        with RewardPool(spec, num_workers=workers, timeout_s=timeout_s) as pool:
            pool_start_s = time.perf_counter() - started  # timed apart, not compared
            print(f"\n{name}: pool of {workers} workers started in {pool_start_s:.2f} s", flush=True)
            result = compare({"serial": scorer("serial", serial), "pool": scorer("pool", pool)}, repeats=repeats,
                             versions=False, show=lambda line: print(line, flush=True),
                             header=f"{name}: {len(request_sets[0]):,} fresh responses a run, work = responses scored")
    if failures:
        print(f"warning: {name}: {failures} reward timeouts or errors in the pool", file=sys.stderr)
    n = len(request_sets[0])
    row = Row(name, n, n / statistics.median(result.seconds["serial"]), pool_start_s,
              n / statistics.median(result.seconds["pool"]), results["serial"] == results["pool"])
    return row, result


def print_table(rows: list[Row], workers: int) -> None:
    print(f"\nreward throughput (median samples/s), {workers} pool workers, {os.cpu_count()} CPUs")
    header = f"{'reward':<16}{'n':>7}{'serial /s':>12}{'pool start s':>14}{'pool /s':>12}{'identical':>11}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row.name:<16}{row.n:>7}{row.serial_per_s:>12,.0f}{row.pool_start_s:>14.2f}{row.pool_per_s:>12,.0f}"
            f"{'yes' if row.identical else 'NO':>11}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="responses per rule reward (default 10000)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="pool workers (default: CPU count)")
    parser.add_argument("--math-verify-n", type=int, default=1000, help="math-verify responses; 0 skips (default 1000)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="time limit per reward call")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (alternating), after a warm-up")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(installed_versions(), flush=True)

    rng = random.Random(args.seed)
    sets = range(1 + args.repeats)  # one fresh set for the warm-up and for each repeat
    cases = [
        ("dapo_math", RewardConfig(), lambda: [dapo_requests(args.n, rng) for _ in sets]),
        ("search_r1_em", RewardConfig(), lambda: [search_r1_requests(args.n, rng) for _ in sets]),
    ]
    if args.math_verify_n > 0:
        cases.append(("math_verify", RewardConfig(weights={"accuracy": 1.0}),
                      lambda: [math_verify_requests(args.math_verify_n, rng) for _ in sets]))
    rows, results = [], {}
    for name, spec, make_sets in cases:
        row, results[name] = measure(name, spec, make_sets(), args.workers, args.timeout_s, args.repeats)
        rows.append(row)
    print_table(rows, args.workers)
    for row in rows:
        if not row.identical:
            print(f"{row.name}: the pool's results differ from the serial ones", file=sys.stderr)
    # the headline, dapo_math (the reward of the DAPO recipes), last
    for row in sorted(rows, key=lambda row: row.name == "dapo_math"):
        print(results[row.name].summary("serial", "pool") + f" ({row.name}, {row.n:,} responses per run)")
    return 0 if all(row.identical for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
