"""Code-reward throughput: test cases per second through the bubblewrap sandbox vs the same
programs run unsandboxed in a plain subprocess.

    python tools/bench/code_reward.py [--programs 40] [--cases 8] [--workers 2] [--repeats 3]

Builds --programs synthetic Python solutions (most correct, some wrong, some crashing) with
--cases stdin/stdout test cases each, and runs every case of every program two ways in the same
process: as `python -I main.py` in a subprocess (the baseline, no isolation) and in the sandbox
(megarl.reward.sandbox.run_cases: a fresh bubblewrap sandbox per case, with its limits), each on
--workers threads (a reward worker runs its cases one after another; several workers run at
once), under the bench protocol (protocol.py): a warm-up of each, then --repeats (>= 3) timed
runs with the two alternated, equal work (cases run) checked. Both must pass the same cases in
every run. Prints the median cases/s of each, then the median sandbox / subprocess ratio and its
range last, against the target of >= 0.5x.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megarl.reward.code import output_matches
from megarl.reward.sandbox import OK, LocalSandbox, run_cases
from megarl.versions import installed_versions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from protocol import compare  # noqa: E402

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


def run_all(work, items, workers: int) -> list:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(work, items))


def passed(results, expected) -> list[list[bool]]:
    return [[ok and output_matches(out, want) for (ok, out), want in zip(rows, wants)]
            for rows, wants in zip(results, expected)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=40)
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (alternating), after a warm-up")
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
    verdicts: dict[str, list] = {"subprocess": [], "sandbox": []}  # which cases passed, per call

    def contender(name: str, work):
        def run() -> int:
            results = run_all(work, batch, args.workers)
            verdicts[name].append(passed(results, expected))
            return sum(map(len, results))  # the work: cases run
        return run

    result = compare({
        "subprocess": contender("subprocess", lambda p: unsandboxed(p[0], p[1], sandbox.python, sandbox.limits.wall_s)),
        "sandbox": contender("sandbox", lambda p: sandboxed(sandbox, p[0], p[1])),
    }, repeats=args.repeats, versions=False, show=lambda line: print(line, flush=True),
        header=f"{args.programs} programs x {args.cases} cases, {args.workers} workers, work = cases run")
    if verdicts["subprocess"] != verdicts["sandbox"]:  # run by run (the warm-up too)
        print("the sandbox and the subprocess disagree on which cases pass", file=sys.stderr)
        return 1
    share = sum(map(sum, verdicts["sandbox"][-1])) / total
    print(f"{share:.0%} of the cases pass")
    for name, seconds in result.seconds.items():
        median = statistics.median(seconds)
        print(f"{name:>10}: {total / median:8.1f} cases/s ({median:.2f} s, median)")
    ratio = statistics.median(result.ratio("subprocess", "sandbox"))
    print(result.summary("subprocess", "sandbox") + f" (target >= 0.5x: {'met' if ratio >= 0.5 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
