"""Reward throughput: serial scoring vs megarl.reward.RewardPool on synthetic responses.

    python tools/bench/rewards.py [--n 10000] [--workers N] [--math-verify-n 1000]

Builds n synthetic responses (correct, wrong and malformed) for DAPO math and for
Search-R1 exact match, plus a smaller math-verify set (its sympy work is ~1000× heavier
per sample, the case the pool is for), scores each set serially in this process and in
a started pool (start-up timed apart; best of --repeats runs, each on fresh responses),
checks the results are identical, and prints samples/s and the pool/serial ratio.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from dataclasses import dataclass

from megarl.reward import RewardConfig, RewardPool, RewardRequest
from megarl.versions import installed_versions

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


def best_time(compute, request_sets: list[list[RewardRequest]]):
    """(shortest wall time over the sets, results of every set). Each timed run scores a
    fresh set, so that no run is sped up by caches (sympy's) warmed on the same
    responses; the best run is the one least disturbed by neighbours on a shared machine."""
    best, all_results, failures = math.inf, [], 0
    for requests in request_sets:
        started = time.perf_counter()
        results, stats = compute(requests)
        best = min(best, time.perf_counter() - started)
        all_results.append(results)
        failures += stats.num_timeouts + stats.num_errors
    return best, all_results, failures


def measure(name: str, spec: RewardConfig, request_sets: list[list[RewardRequest]], workers: int,
            timeout_s: float) -> Row:
    with RewardPool(spec, num_workers=0, timeout_s=timeout_s) as serial:
        serial_s, expected, _ = best_time(serial.compute, request_sets)
    started = time.perf_counter()
    with RewardPool(spec, num_workers=workers, timeout_s=timeout_s) as pool:
        pool_start_s = time.perf_counter() - started
        pool_s, results, failures = best_time(pool.compute, request_sets)
    if failures:
        print(f"warning: {name}: {failures} reward timeouts or errors in the pool", file=sys.stderr)
    n = len(request_sets[0])
    return Row(name, n, n / serial_s, pool_start_s, n / pool_s, results == expected)


def print_table(rows: list[Row], workers: int) -> None:
    print(f"\nreward throughput, {workers} pool workers, {os.cpu_count()} CPUs")
    header = f"{'reward':<16}{'n':>7}{'serial /s':>12}{'pool start s':>14}{'pool /s':>12}{'pool/serial':>13}{'identical':>11}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row.name:<16}{row.n:>7}{row.serial_per_s:>12,.0f}{row.pool_start_s:>14.2f}{row.pool_per_s:>12,.0f}"
            f"{row.pool_per_s / row.serial_per_s:>12.2f}x{'yes' if row.identical else 'NO':>11}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="responses per rule reward (default 10000)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="pool workers (default: CPU count)")
    parser.add_argument("--math-verify-n", type=int, default=1000, help="math-verify responses; 0 skips (default 1000)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="time limit per reward call")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs, each on fresh responses; the best counts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(installed_versions(), flush=True)

    rng = random.Random(args.seed)
    runs = range(args.repeats)
    cases = [
        ("dapo_math", RewardConfig(), [dapo_requests(args.n, rng) for _ in runs]),
        ("search_r1_em", RewardConfig(), [search_r1_requests(args.n, rng) for _ in runs]),
    ]
    if args.math_verify_n > 0:
        cases.append(("math_verify", RewardConfig(weights={"accuracy": 1.0}),
                      [math_verify_requests(args.math_verify_n, rng) for _ in runs]))
    rows = [measure(name, spec, sets, args.workers, args.timeout_s) for name, spec, sets in cases]
    print_table(rows, args.workers)
    return 0 if all(row.identical for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
