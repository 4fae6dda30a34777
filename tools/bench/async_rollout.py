"""Benchmark: asynchronous rollouts (staleness 1), with and without partial rollouts (abort and
continue at each weight sync), against two synchronous loops, on the same short CPU run.

The run is the quickstart's Search-R1 + DAPO loop (multi-turn search, dynamic sampling) on
inputs prepared here as `make quickstart` prepares them (its warmed-up model searches or
guesses, so trajectories take one to three turns), except that the model is warmed up to
reason before each action (`prepare --think-words 8`: log-normally many words, median 8, at
most 128), so that response lengths have a long tail as DAPO's do. It runs on the Ray
launcher, with the engine's concurrency at its default. Two synchronous baselines, both printed:
- disaggregated, as on a cluster where the engines have GPUs of their own: this script pins
  every thread of the engine's process to core 0 and of the train worker's to core 1 (one
  thread each), so time the loop spends waiting shows as an idle core, the way it shows as
  idle GPUs;
- colocated, as a colocated run shares its GPUs: no pinning, and each phase (generation, then
  training) uses both cores.
The asynchronous loops run disaggregated: the engine generates the next batch on its core
while the trainer trains on the other.

Steps per second come from each run's own `perf/step_s` (the first step, its start-up, left
out), under the bench protocol (protocol.py: 3 timed repeats with the variants' order
alternated, the median ratio last). Equal work: the response tokens per step and the
generation batches per step (dynamic sampling) are equal in expectation, not exactly (sampled
lengths; an asynchronous step trains on tokens of the previous weights); both are printed and
checked within WORK_TOLERANCE. Where two variants' tokens differ, the ratio that counts is
response tokens a second (a loop that trained on fewer tokens is not faster for it): each pair
prints both, and the last line, against the target, prints tokens a second.

    python tools/bench/async_rollout.py [--steps 6] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from megarl.versions import installed_versions
from protocol import Measured, compare

ROOT = Path(__file__).resolve().parents[2]
PINNED = ["cluster.threads_per_rank=1"]  # one thread on each pinned core
ASYNC = ["trainer.async_rollout.enable=true", "trainer.async_rollout.max_staleness=1"]
VARIANTS = {  # name -> (overrides, whether its engine and trainer are pinned to a core each)
    "synchronous, disaggregated": (PINNED, True),
    "synchronous, colocated": ([], False),
    "asynchronous": (PINNED + ASYNC, True),
    "asynchronous + partial rollouts": (PINNED + ASYNC + ["trainer.async_rollout.partial_rollouts=abort"], True),
}
# room for the reasoning the model learnt (at most 16x the median words, about a token each)
LONG_RESPONSES = ["agent.max_turn_length=192", "rollout.max_response_length=512"]
WORK_TOLERANCE = 0.2  # response tokens per step of two runs: equal in expectation, sampled
PINS = {"EngineActor": {0}, "TrainWorkerActor": {1}}  # process title -> its core


def pin_actors(stop: threading.Event) -> None:
    """Every thread of the engine's and the train worker's processes on its own core, again
    every half second (threads started later are pinned too)."""
    while not stop.wait(0.5):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                cores = next((c for name, c in PINS.items() if f"ray::{name}" in title), None)
                if cores is None:
                    continue
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.sched_setaffinity(int(tid), cores)
            except (OSError, ValueError):
                continue  # a process or thread that just ended


def prepare(work: Path, think_words: int) -> Path:
    """The quickstart's inputs, its model warmed up to reason before each action (skipped when
    built alike)."""
    inputs = work / "inputs"
    subprocess.run([sys.executable, "-m", "megarl.quickstart", "prepare", str(inputs), "--think-words",
                    str(think_words)], check=True, timeout=3600)
    return inputs


def run_variant(name: str, extra: list[str], pinned: bool, inputs: Path, work: Path, steps: int) -> dict[str, float]:
    """One run of the quickstart config with this variant's overrides; its step metrics."""
    from megarl.config import load_config
    from megarl.train import train

    # a directory of its own, never a resumed run (and never one removed and made again: this
    # process's MLflow keeps its database open)
    out = Path(tempfile.mkdtemp(prefix=name.replace(" ", "_").replace(",", "").replace("+", "plus") + "-", dir=work))
    q = str(inputs)
    overrides = [f"model.path={q}/model", f"data.train_files=[{q}/data/train.parquet]",
                 f"data.val_files=[{q}/data/val.parquet]", f"agent.retrieval.index_dir={q}/index",
                 f"trainer.output_dir={out}", f"trainer.total_training_steps={steps}", "trainer.resume=disable",
                 "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=0",
                 "tracking.log_rollouts_freq=0", "algorithm.tis_cap=2.0", "cluster.launcher=ray",
                 "cluster.cpus_per_node=4", *LONG_RESPONSES, *extra]
    stop = threading.Event()
    if pinned:
        threading.Thread(target=pin_actors, args=(stop,), daemon=True).start()
    try:
        cfg = load_config(str(ROOT / "examples/quickstart/search_r1_tiny.yaml"), overrides)
        train(cfg)
    finally:
        stop.set()
    return read_metrics(out, samples=cfg.data.train_batch_size * cfg.rollout.n)


def read_metrics(out: Path, samples: int) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    from megarl.tracking import local_store_uri

    client = MlflowClient(tracking_uri=local_store_uri(out))
    (run,) = client.search_runs([client.get_experiment_by_name("megarl").experiment_id])

    def values(name):
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)][1:]

    step_s = values("perf/step_s")
    lengths = values("train/response_length_mean")
    return {"seconds": sum(step_s), "step_s": statistics.mean(step_s), "tokens": sum(lengths) * samples,
            "tokens_per_step": statistics.mean(lengths) * samples,
            "gen_batches": statistics.mean(values("train/gen_batches")),
            "trainer_busy": statistics.mean(values("perf/trainer_busy_fraction")),
            "engine_busy": statistics.mean(values("perf/engine_busy_fraction")),
            "staleness_mean": statistics.mean(values("rollout/staleness_mean")),
            "continued": sum(values("rollout/partial_continued")),
            "reward": statistics.mean(values("train/reward_mean"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (the first is not timed)")
    parser.add_argument("--think-words", type=int, default=8,
                        help="median words of reasoning before each action (log-normal, the long tail of response "
                             "lengths; 0 = the quickstart's model, which acts at once)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant (their order alternated)")
    parser.add_argument("--work", type=Path, default=None, help="where inputs and runs go (default: a temp dir)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more config overrides for every variant")
    args = parser.parse_args()
    print(installed_versions(), flush=True)  # first: the inputs are prepared before the runs
    if (os.cpu_count() or 1) < 2:
        sys.exit("this benchmark pins the engine and the trainer to a core each: it needs 2 cores")
    work = args.work or Path(tempfile.mkdtemp(prefix="megarl-bench-async-"))
    inputs = prepare(work, args.think_words)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}

    def variant(name: str):
        def run() -> Measured:
            extra, pinned = VARIANTS[name]
            runs[name].append(run_variant(name, args.set + extra, pinned, inputs, work, args.steps))
            return Measured(runs[name][-1]["tokens"], runs[name][-1]["seconds"])
        return run

    result = compare({name: variant(name) for name in VARIANTS}, repeats=args.repeats, warmups=0,
                     work_tolerance=WORK_TOLERANCE, versions=False, show=lambda line: print(line, flush=True),
                     header=f"{args.steps} steps a run, the first untimed; work = response tokens of the timed steps")
    print(f"\n{'variant':<32} {'s/step':>7} {'tokens/step':>12} {'gen batches':>12} {'trainer busy':>13} "
          f"{'engine busy':>12} {'staleness':>10} {'continued':>10} {'reward':>7}")
    for name, rows in runs.items():
        def mean(key):
            return statistics.mean(r[key] for r in rows)
        print(f"{name:<32} {mean('step_s'):>7.2f} {mean('tokens_per_step'):>12.0f} {mean('gen_batches'):>12.2f} "
              f"{mean('trainer_busy'):>13.2f} {mean('engine_busy'):>12.2f} {mean('staleness_mean'):>10.2f} "
              f"{mean('continued'):>10.1f} {mean('reward'):>7.3f}")
    batches = [statistics.mean(r["gen_batches"] for r in rows) for rows in runs.values()]
    if max(batches) - min(batches) > WORK_TOLERANCE * max(batches):
        sys.exit(f"unequal work: generation batches per step {batches} differ by more than {WORK_TOLERANCE:.0%}")
    for baseline in ("synchronous, disaggregated", "synchronous, colocated"):
        for name in ("asynchronous", "asynchronous + partial rollouts"):
            print(headline(result, baseline, name, both=True))
    best = min(("synchronous, disaggregated", "synchronous, colocated"),
               key=lambda n: statistics.median(result.seconds[n]))
    print(f"the better synchronous baseline: {best}; target: asynchronous >= 1.5x it")
    print(headline(result, best, "asynchronous"))


def headline(result, baseline: str, name: str, both: bool = False) -> str:
    """Steps a second where the two trained on the same tokens; where they did not (the
    asynchronous loop's are equal only in expectation), tokens a second, steps a second beside it
    when `both`."""
    steps = result.summary(baseline, name) + " [steps a second]"
    if not result.work_differs(baseline, name):
        return steps
    tokens = result.summary(baseline, name, per="response token")
    return f"{tokens}; {steps}" if both else tokens


if __name__ == "__main__":
    main()
