"""Code-reward throughput: test cases per second through the bubblewrap sandbox vs the same
programs run unsandboxed in a plain subprocess.

    python tools/bench/code_reward.py [--programs 40] [--cases 8] [--workers 2] [--repeats 3]

Builds --programs synthetic Python solutions (most correct, some wrong, some crashing) with
--cases stdin/stdout test cases each, and runs every case of every program twice in the same
process: once as `python -I main.py` in a subprocess (the baseline, no isolation), once in the
sandbox (megarl.reward.sandbox.run_cases: a fresh bubblewrap sandbox per case, with its limits),
each on --workers threads (a reward worker runs its cases one after another; several workers
run at once). Both must pass the same cases. Prints cases/s of each (best of --repeats) and the
ratio sandbox / baseline last; the target is >= 0.5x.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megarl.reward.code import output_matches
from megarl.reward.sandbox import OK, LocalSandbox, run_cases
from megarl.versions import installed_versions

TASKS = [  # (program, how the expected output is computed from the input numbers)
    ("nums = list(map(int, open(0).read().split()))\nprint(sum(nums))", lambda xs: str(sum(xs))),
    ("nums = sorted(map(int, open(0).read().split()))\nprint(' '.join(map(str, nums)))",
     lambda xs: " ".join(map(str, sorted(xs)))),
    ("nums = list(map(int, open(0).read().split()))\nprint(max(nums) - min(nums))", lambda xs: str(max(xs) - min(xs))),
]
WRONG = "nums = list(map(int, open(0).read().split()))\nprint(sum(nums) + 1)"
CRASH = "raise ValueError('no')"


def programs(n: int, cases: int, rng: random.Random) -> list[tuple[str, list[str], list[str]]]:
    out = []
    for i in range(n):
        source, answer = TASKS[i % len(TASKS)]
        if i % 10 == 7:
            source = WRONG
        elif i % 10 == 9:
            source = CRASH
        numbers = [[rng.randint(-1000, 1000) for _ in range(rng.randint(1, 50))] for _ in range(cases)]
        out.append((source, [" ".join(map(str, xs)) + "\n" for xs in numbers], [answer(xs) for xs in numbers]))
    return out


def unsandboxed(source: str, inputs: list[str], python: str, wall_s: float) -> list[tuple[bool, str]]:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "main.py"
        path.write_text(source)
        results = []
        for stdin in inputs:
            try:
                run = subprocess.run([python, "-I", str(path)], input=stdin, capture_output=True, text=True,
                                     timeout=wall_s)
                results.append((run.returncode == 0, run.stdout))
            except subprocess.TimeoutExpired:
                results.append((False, ""))
        return results


def sandboxed(sandbox: LocalSandbox, source: str, inputs: list[str]) -> list[tuple[bool, str]]:
    return [(r.status == OK, r.stdout) for r in run_cases(sandbox, "python", source, inputs)]


def timed(work, items, workers: int) -> tuple[float, list]:
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(work, items))
    return time.perf_counter() - start, results


def passed(results, expected) -> list[list[bool]]:
    return [[ok and output_matches(out, want) for (ok, out), want in zip(rows, wants)]
            for rows, wants in zip(results, expected)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=40)
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(installed_versions(("megarl",)), flush=True)
    sandbox = LocalSandbox()
    sandbox.check()
    print(f"bubblewrap {subprocess.run([sandbox.bwrap, '--version'], capture_output=True, text=True).stdout.split()[-1]}"
          f", programs run by {sandbox.python}", flush=True)
    rng = random.Random(args.seed)
    batch = programs(args.programs, args.cases, rng)
    expected = [b[2] for b in batch]
    total = args.programs * args.cases
    best = {"subprocess": float("inf"), "sandbox": float("inf")}
    for _ in range(args.repeats):
        seconds, plain = timed(lambda p: unsandboxed(p[0], p[1], sandbox.python, sandbox.limits.wall_s), batch,
                               args.workers)
        best["subprocess"] = min(best["subprocess"], seconds)
        seconds, boxed = timed(lambda p: sandboxed(sandbox, p[0], p[1]), batch, args.workers)
        best["sandbox"] = min(best["sandbox"], seconds)
        if passed(plain, expected) != passed(boxed, expected):
            print("the sandbox and the subprocess disagree on which cases pass", file=sys.stderr)
            return 1
    share = sum(map(sum, passed(boxed, expected))) / total
    print(f"{args.programs} programs x {args.cases} cases, {args.workers} workers, {share:.0%} of the cases pass")
    for name, seconds in best.items():
        print(f"{name:>10}: {total / seconds:8.1f} cases/s ({seconds:.2f} s)")
    print(f"ratio sandbox / subprocess: {best['subprocess'] / best['sandbox']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
