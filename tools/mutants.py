"""Mutation testing of the code whose silent errors would cost a run (`make mutants`): mutmut
changes one operator, constant or call at a time in the modules below and runs the tests that
reach the changed function; a mutant the tests do not fail on ("survived") is a change nobody
would notice. Prints, per module, the mutants killed (a test failed, or the change made a test
hang past mutmut's deadline), survived, equivalent (the change alters no behaviour: listed with
the reason in docs/testing.md, "Equivalent mutants") and the share killed of the rest.

    python tools/mutants.py                      # every group, every mutant (make mutants)
    python tools/mutants.py --group algo         # one group
    python tools/mutants.py --sample 60 --seed "$(git rev-parse HEAD)"   # .ci/run's bounded sample

Each group runs in its own copy of the working tree under build/mutants/<group> (mutmut writes
its mutated copy, `mutants/`, there). The mutated code is what the test process and its forks
import (mutmut puts it first on sys.path; a PYTHONPATH pointing there stops mutmut from finding
which tests reach which function), so the groups' tests are those that call the code in-process. The full run exits 1 when a module is under --target (90%);
the sample, which runs the mutants of functions drawn by the seed until its time is up, exits 1
on a survivor listed neither as equivalent (docs/testing.md) nor as not yet killed
(docs/mutation-survivors.md): a new survivor is code no test checks, or a check that stopped checking.

Why mutmut: it is maintained, runs pytest in forked workers on the tests that cover each
function (measured once per run), so a group of several hundred mutants takes minutes on two
cores; cosmic-ray runs the whole test command for every mutant.
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "mutants"
EQUIVALENTS_DOC = ROOT / "docs" / "testing.md"  # "Equivalent mutants"
SURVIVORS_DOC = ROOT / "docs" / "mutation-survivors.md"  # "Survivors not yet killed"
NOT_IN_MAKE_TEST = "not slow and not ui and not sglang and not gpu"
CALL_S = 120  # the deadline of each git and mutmut query (the run itself has the sample's or none)
REAP_S = 15  # how often a run's orphaned processes are looked for while it goes on


@dataclass(frozen=True)
class Group:
    mutate: tuple[str, ...]  # files (globs) whose functions are mutated
    tests: tuple[str, ...]  # the test files mutmut chooses from
    functions: tuple[str, ...] = ()  # only these functions of the files (all when empty)
    deselect: tuple[str, ...] = ()  # tests left out (those that start Ray: seconds each, and a mutant may hang them)
    sampled: bool = True  # drawn by the CI sample (off until its survivors are killed or listed)


GROUPS = {
    "algo": Group(("megarl/algo/*.py",),
                  ("tests/test_algo_advantages.py", "tests/test_algo_aggregation.py",
                   "tests/test_algo_dynamic_sampling.py", "tests/test_algo_kl.py", "tests/test_algo_masked.py",
                   "tests/test_algo_overlong.py", "tests/test_algo_policy_loss.py", "tests/test_algo_groups.py",
                   "tests/test_experience.py", "tests/test_moe_loss.py", "tests/test_algo_edges.py",
                   "tests/test_algo_registry.py")),
    "rewards": Group(("megarl/reward/dapo_math.py", "megarl/reward/search_r1.py", "megarl/reward/registry.py"),
                     ("tests/test_reward_dapo_math.py", "tests/test_reward_search_r1.py",
                      "tests/test_reward_registry.py", "tests/test_reward_scoring.py", "tests/test_reward_edges.py")),
    "tools": Group(("megarl/tools/calculator.py", "megarl/tools/base.py"), ("tests/test_tools.py",),
                   sampled=False),  # drawn by CI once its survivors are killed or listed
    "packing": Group(("megarl/backends/packed.py", "megarl/backends/epochs.py"),
                     ("tests/test_packed_batch.py", "tests/test_rank_shares.py", "tests/test_packing_edges.py"),
                     deselect=("tests/test_rank_shares.py::test_each_rank_gets_its_share_and_one_answer_per_share_"
                               "comes_back", "tests/test_rank_shares.py::test_the_routing_crosses_once_for_the_"
                               "log_probs_and_the_update")),
    # samples of one prompt forwarded with it once (actor.share_prompts)
    "prompts": Group(("megarl/backends/torch/shared_prompts.py", "megarl/backends/torch/logprobs.py"),
                     ("tests/test_shared_prompts.py", "tests/test_backend_torch_actor.py"),
                     functions=tuple(f"megarl/backends/torch/shared_prompts.py:{f}" for f in (
                         "prompt_plan", "shared_prompt_logits", "cache_names"))
                     + ("megarl/backends/torch/logprobs.py:_shared", "megarl/backends/torch/logprobs.py:_checkpointed")),
    "order": Group(("megarl/train.py",), ("tests/test_mini_batch_order.py",),
                   functions=("megarl/train.py:in_update_order", "megarl/train.py:one_update_order",
                              "megarl/train.py:update_order", "megarl/train.py:updates")),
    "weights": Group(tuple(f"megarl/weights/{m}.py" for m in ("__init__", "buckets", "disk", "group", "inprocess",
                                                               "probe", "routes", "transport")),
                     ("tests/test_sync.py", "tests/test_weight_probe.py", "tests/test_weights_edges.py",
                      "tests/test_weight_transports.py",
                      "tests/test_rollout_http.py", "tests/test_gpu_contract.py", "tests/test_sglang_contract.py"),
                     sampled=False),
    # the ipc transport's collectives: tests/test_ipc_ranks.py forks its ranks from the test process,
    # so each runs the mutated code
    "ipc": Group(("megarl/weights/ipc.py",),
                 ("tests/test_ipc_ranks.py", "tests/test_weight_transports.py", "tests/test_weights_edges.py",
                  "tests/test_gpu_contract.py", "tests/test_sglang_contract.py"),
                 sampled=False),
    "resume": Group(("megarl/checkpoint.py", "megarl/data/prompts.py"),
                    ("tests/test_checkpoint.py", "tests/test_checkpoint_edges.py", "tests/test_checkpoint_faults.py",
                     "tests/test_data_prompts.py", "tests/test_prompts_edges.py", "tests/test_train_loop.py"),
                    deselect=("tests/test_train_loop.py::test_ray_launcher_trains_exactly_like_one_process",)),
}

KILLED = {"killed", "segfault"}  # a test failed, or the test process crashed
# "timeout" (a test ran past mutmut's deadline) is counted apart, as neither: a mutant can hang a test,
# and so can a fork of a process that held threads or a Ray connection (what made every mutant of a
# function a training step calls "time out" before the workers ran with one OpenMP thread)
SURVIVED = {"survived", "no tests"}  # no test failed: none ran, or all passed


@dataclass
class Tally:
    killed: int = 0
    survived: list[tuple[str, str, str]] = field(default_factory=list)  # (name, removed line, added line)
    equivalent: int = 0
    other: dict[str, int] = field(default_factory=dict)  # no tests, not checked, ...
    known: list[str] = field(default_factory=list)  # survivors listed as not yet killed

    def score(self) -> float | None:
        tried = self.killed + len(self.survived)
        return None if tried == 0 else self.killed / tried


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=CALL_S).stdout
    return [line for line in out.splitlines() if line and (ROOT / line).is_file()]


def prepare(name: str, group: Group) -> Path:
    """A fresh copy of the working tree for the group, with its mutmut settings."""
    work = WORK / name
    if work.exists():
        shutil.rmtree(work)
    for rel in tracked_files():
        target = work / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    quoted = lambda items: "[" + ", ".join(f'"{i}"' for i in items) + "]"  # noqa: E731
    with open(work / "pyproject.toml", "a") as f:
        f.write(f"""
[tool.mutmut]
source_paths = ["megarl"]
only_mutate = {quoted(group.mutate)}
pytest_add_cli_args_test_selection = {quoted(t for t in group.tests if (ROOT / t).exists())}
pytest_add_cli_args = {quoted(["-p", "no:cacheprovider", "-q", "-m", NOT_IN_MAKE_TEST,
                               *(f"--deselect={d}" for d in group.deselect)])}
timeout_multiplier = 4.0
also_copy = ["examples", "tools", "ckpt_convert"]
debug = true
""")  # pytest's output in the log
    return work


def module_of(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def mutated(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether mutmut mutates this function: it leaves decorated ones alone, save a lone
    @staticmethod or @classmethod (a pattern for one of the others matches no mutant, and mutmut
    stops when none of its patterns matches)."""
    if not node.decorator_list:
        return True
    return (len(node.decorator_list) == 1 and isinstance(node.decorator_list[0], ast.Name)
            and node.decorator_list[0].id in ("staticmethod", "classmethod"))


def functions_of(group: Group) -> list[str]:
    """mutmut's name patterns of the group's functions that it mutates: module.x_function__mutmut_*
    and, for a method, module.xǁClassǁmethod__mutmut_*. A function the group names that is not
    there, or that mutmut leaves alone, is an error in the group."""
    patterns = []
    for spec in group.functions or tuple(f"{g}:*" for g in group.mutate):
        glob, wanted = spec.split(":")
        found = []
        for path in sorted(ROOT.glob(glob)):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text())
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and wanted in ("*", node.name):
                    found += [f"{module_of(rel)}.x_{node.name}__mutmut_*"] if mutated(node) else []
                elif isinstance(node, ast.ClassDef) and wanted == "*":
                    found += [f"{module_of(rel)}.xǁ{node.name}ǁ{item.name}__mutmut_*" for item in node.body
                              if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and mutated(item)]
        if wanted != "*" and not found:
            raise SystemExit(f"mutants: {spec} names no function that mutmut mutates (missing, or decorated)")
        patterns += found
    return patterns


def run_mutmut(work: Path, patterns: list[str], deadline: float | None, log) -> bool:
    """mutmut run in `work`; False when it was stopped at the deadline (the results so far stay)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
    # mutmut forks its workers from a process that ran the tests: a torch OpenMP pool in that parent
    # deadlocks the children (every mutant of a function a training step calls "timed out", a false
    # kill); one thread each, and no pool to inherit
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(os.cpu_count() or 2), *patterns]
    process = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        reaped_at = time.monotonic()
        while process.poll() is None:
            if time.monotonic() - reaped_at > REAP_S:  # a killed worker's servers, while the run goes on
                stragglers(work, keep=process.pid)
                reaped_at = time.monotonic()
            if deadline is not None and time.monotonic() > deadline:
                os.killpg(process.pid, signal.SIGINT)  # mutmut keeps what it has finished
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
                return False
            time.sleep(1)
    finally:
        stragglers(work)
    if process.returncode:
        log.flush()
        tail = Path(log.name).read_text(errors="replace").splitlines()
        if any("Filtered for specific mutants, but nothing matches" in line for line in tail[-5:]):
            print("   none of these functions has a mutant (mutmut stopped on an empty filter)", flush=True)
            return True
        print("\n".join(tail[-40:]), flush=True)  # CI keeps the output, not the build directory
        raise SystemExit(f"mutmut failed ({process.returncode}) in {work}; its log: {log.name}")
    return True


def stragglers(work: Path, keep: int | None = None) -> None:
    """Kill what a run left behind: workers of a mutant that hung, and what their tests started
    (servers, ranks) when the test process was killed first. Found by their working directory or
    command line under `work` (a test's servers start sessions of their own). With `keep` (the
    running mutmut's pid), only those no longer below it: orphans of a worker mutmut killed at
    its timeout, whose fixtures never stopped their servers (92 of them filled 17 GB in one run)."""
    import psutil

    inside = str(work)
    alive = set()
    if keep is not None:
        try:
            alive = {keep, *(c.pid for c in psutil.Process(keep).children(recursive=True))}
        except psutil.Error:
            return
    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            if p.pid != os.getpid() and p.pid not in alive and (inside in " ".join(p.info["cmdline"] or ()) or
                                                                (p.info["cwd"] or "").startswith(inside)):
                p.kill()
        except psutil.Error:
            pass


def results(work: Path) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=work,
                         capture_output=True, text=True, check=True, timeout=CALL_S).stdout
    found = {}
    for line in out.splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name:
            found[name] = status
    return found


def mutant_module(name: str) -> str:
    return re.split(r"\.xǁ|\.x_", name, maxsplit=1)[0]


def mutant_function(name: str) -> str:
    rest = re.split(r"\.(?=xǁ|x_)", name, maxsplit=1)[1]
    rest = rest.rsplit("__mutmut_", 1)[0]
    return rest.removeprefix("xǁ").removeprefix("x_").replace("ǁ", ".")


def changed_lines(work: Path, name: str) -> tuple[str, str]:
    """The mutant's (removed, added) source lines, stripped, as `mutmut show` gives them."""
    out = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=work, capture_output=True,
                         text=True, timeout=CALL_S).stdout
    minus = [line[1:].strip() for line in out.splitlines() if line.startswith("-") and not line.startswith("---")]
    plus = [line[1:].strip() for line in out.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return " / ".join(minus), " / ".join(plus)


def listed(doc: Path, heading: str) -> dict[tuple[str, str, str], str]:
    """The table of `doc` under `heading` (Equivalent mutants, Survivors not yet killed):
    (module, function, mutated line) -> the reason given."""
    text = doc.read_text() if doc.exists() else ""
    start = text.find(heading)
    found = {}
    if start < 0:
        return found
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]] if line.startswith("|") else []
        if len(cells) == 3 and cells[0].startswith("`"):
            where, mutated, why = (c.strip("`").replace("\\|", "|") for c in cells)
            module, _, function = where.partition(":")
            found[(module, function, mutated)] = why
    return found


def tally(work: Path, statuses: dict[str, str], equivalent: dict, known: dict) -> dict[str, Tally]:
    per_module: dict[str, Tally] = {}
    for name, status in sorted(statuses.items()):
        t = per_module.setdefault(mutant_module(name), Tally())
        if status in KILLED:
            t.killed += 1
        elif status in SURVIVED:
            removed, added = changed_lines(work, name)
            key = (mutant_module(name), mutant_function(name), added)
            if key in equivalent:
                t.equivalent += 1
            else:
                t.survived.append((name, removed, added))
                if key in known:
                    t.known.append(name)
        else:
            t.other[status] = t.other.get(status, 0) + 1
    return per_module


def report(per_module: dict[str, Tally], target: float) -> list[str]:
    """Print the figures and the survivors; the modules under target."""
    under = []
    print(f"{'module':42} {'killed':>7} {'survived':>9} {'equivalent':>11} {'killed %':>9}  other (not counted)")
    for module, t in per_module.items():
        score = t.score()
        shown = "-" if score is None else f"{100 * score:.1f}"
        other = ", ".join(f"{k} {v}" for k, v in t.other.items())
        print(f"{module:42} {t.killed:7} {len(t.survived):9} {t.equivalent:11} {shown:>9}  {other}")
        if score is not None and score < target:
            under.append(module)
    for module, t in per_module.items():
        for name, removed, added in t.survived:
            print(f"survived {name}{' (listed: not yet killed)' if name in t.known else ''}"
                  f"\n    - {removed}\n    + {added}")
    return under


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", action="append", choices=sorted(GROUPS), help="(repeatable) default: all")
    parser.add_argument("--sample", type=float, default=0.0,
                        help="seconds: run the mutants of functions drawn by --seed until then (CI)")
    parser.add_argument("--seed", default="0", help="what draws the sample (CI: the commit)")
    parser.add_argument("--target", type=float, default=0.9, help="share of non-equivalent mutants to kill")
    parser.add_argument("--tally", action="store_true",
                        help="count the results of the last run again (after docs/testing.md's lists changed)")
    args = parser.parse_args()
    names = args.group or [n for n in GROUPS if GROUPS[n].sampled or not args.sample]
    equivalent = listed(EQUIVALENTS_DOC, "### Equivalent mutants")
    known = listed(SURVIVORS_DOC, "### Survivors not yet killed")
    failed = []
    deadline = time.monotonic() + args.sample if args.sample else None
    if args.sample:  # one group at a time, drawn by the seed, until the time is up
        random.Random(args.seed).shuffle(names)
    for name in names:
        if deadline is not None and time.monotonic() > deadline - 30:
            break
        group = GROUPS[name]
        patterns = functions_of(group)
        if args.sample:  # a quarter of the group's functions, drawn by the seed
            patterns = random.Random(f"{args.seed}/{name}").sample(patterns, max(1, len(patterns) // 4))
        elif not group.functions:
            patterns = []  # all of the group's files
        print(f"== {name}: {', '.join(group.mutate)} against {len(group.tests)} test files", flush=True)
        work, started, whole = WORK / name, time.monotonic(), True
        if not args.tally:
            work = prepare(name, group)
            with open(work / "mutmut.log", "w") as log:
                whole = run_mutmut(work, patterns, deadline, log)
        statuses = {k: v for k, v in results(work).items() if v != "not checked"}
        print(f"   {len(statuses)} mutants in {time.monotonic() - started:.0f} s"
              f"{'' if whole else ' (stopped at the sample time)'}; log: {work / 'mutmut.log'}")
        per_module = tally(work, statuses, equivalent, known)
        under = report(per_module, args.target)
        if args.sample:
            failed += [f"{m}: {len(t.survived) - len(t.known)} survived, not listed" for m, t in per_module.items()
                       if len(t.survived) > len(t.known)]
        else:
            failed += [f"{m}: under {100 * args.target:.0f}%" for m in under]
    if failed:
        print("mutants: " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
