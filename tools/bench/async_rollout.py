"""Benchmark: the synchronous loop vs asynchronous rollouts (staleness 1) vs asynchronous with
partial rollouts (abort and continue at each weight sync), on the same short CPU run.

The run is the quickstart's Search-R1 + DAPO loop (multi-turn search, dynamic sampling) on
inputs prepared here as `make quickstart` prepares them (its warmed-up model searches or
guesses, so trajectories take one to three turns). It runs disaggregated, as on a cluster where the engines have GPUs of
their own: the Ray launcher puts the embedded engine and the train worker in processes of
their own, and this script pins every thread of the engine's process to core 0 and of the
train worker's to core 1 (Ray gives each one thread of math), so time the synchronous loop
spends waiting shows as an idle core, the way it shows as idle GPUs. The engine's batch is
capped at 4 sequences (SCENARIO) so that generation takes about as long as training. Steps per second come
from the run's own `perf/step_s` (the first step left out: start-up), busy fractions from
`perf/trainer_busy_fraction` and `perf/engine_busy_fraction`.

    python tools/bench/async_rollout.py [--steps 6] [--work DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from megarl.versions import installed_versions

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {
    "synchronous": [],
    "async, staleness 1": ["trainer.async_rollout.enable=true", "trainer.async_rollout.max_staleness=1"],
    "async + partial rollouts": ["trainer.async_rollout.enable=true", "trainer.async_rollout.max_staleness=1",
                                 "trainer.async_rollout.partial_rollouts=abort"],
}
# The engine holds 4 sequences at a time (a GPU engine's KV memory bounds its batch the same way),
# so that generating a batch takes about as long as training on it, as in real DAPO runs where
# generation is half of a step or more; with the embedded engine's default (1024) the tiny
# model's batch is generated in a fifth of the trainer's time and there is little to overlap.
SCENARIO = ["rollout.max_concurrency=4"]
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


def prepare(work: Path) -> Path:
    inputs = work / "inputs"
    if not (inputs / "model").exists():
        subprocess.run([sys.executable, "-m", "megarl.quickstart", "prepare", str(inputs)], check=True)
    return inputs


def run_variant(name: str, extra: list[str], inputs: Path, work: Path, steps: int) -> dict[str, float]:
    """One run of the quickstart config with this variant's overrides; its step metrics."""
    from megarl.config import load_config
    from megarl.train import train

    out = work / name.replace(" ", "_").replace(",", "").replace("+", "plus")
    shutil.rmtree(out, ignore_errors=True)  # a run of its own, never a resumed one
    q = str(inputs)
    overrides = [f"model.path={q}/model", f"data.train_files=[{q}/data/train.parquet]",
                 f"data.val_files=[{q}/data/val.parquet]", f"agent.retrieval.index_dir={q}/index",
                 f"trainer.output_dir={out}", f"trainer.total_training_steps={steps}", "trainer.resume=disable",
                 "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=0",
                 "tracking.log_rollouts_freq=0", "algorithm.tis_cap=2.0", "cluster.launcher=ray",
                 "cluster.cpus_per_node=4", *extra]
    stop = threading.Event()
    pinner = threading.Thread(target=pin_actors, args=(stop,), daemon=True)
    pinner.start()
    try:
        train(load_config(str(ROOT / "examples/quickstart/search_r1_tiny.yaml"), overrides))
    finally:
        stop.set()
    return read_metrics(out)


def read_metrics(out: Path) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    from megarl.tracking import local_store_uri

    client = MlflowClient(tracking_uri=local_store_uri(out))
    (run,) = client.search_runs([client.get_experiment_by_name("megarl").experiment_id])

    def values(name):
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)][1:]

    step_s = values("perf/step_s")
    return {"steps_per_s": 1.0 / statistics.mean(step_s), "step_s": statistics.mean(step_s),
            "trainer_busy": statistics.mean(values("perf/trainer_busy_fraction")),
            "engine_busy": statistics.mean(values("perf/engine_busy_fraction")),
            "staleness_mean": statistics.mean(values("rollout/staleness_mean")),
            "continued": sum(values("rollout/partial_continued")),
            "reward": statistics.mean(values("train/reward_mean"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="training steps per variant (the first is not timed)")
    parser.add_argument("--work", type=Path, default=None, help="where inputs and runs go (default: a temp dir)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more config overrides for every variant")
    parser.add_argument("--only", nargs="*", default=None, help="variants to run (default: all)")
    args = parser.parse_args()
    print(installed_versions(), flush=True)
    if (os.cpu_count() or 1) < 2:
        sys.exit("this benchmark pins the engine and the trainer to a core each: it needs 2 cores")
    work = args.work or Path(tempfile.mkdtemp(prefix="megarl-bench-async-"))
    inputs = prepare(work)
    results = {}
    for name, extra in VARIANTS.items():
        if args.only is not None and name not in args.only:
            continue
        started = time.perf_counter()
        results[name] = run_variant(name, SCENARIO + args.set + extra, inputs, work, args.steps)
        print(f"{name}: {time.perf_counter() - started:.0f} s in all", file=sys.stderr, flush=True)
    print(f"\n{'variant':<26} {'steps/s':>8} {'s/step':>7} {'trainer busy':>13} {'engine busy':>12} "
          f"{'staleness':>10} {'continued':>10} {'reward':>7}")
    for name, r in results.items():
        print(f"{name:<26} {r['steps_per_s']:>8.4f} {r['step_s']:>7.1f} {r['trainer_busy']:>13.2f} "
              f"{r['engine_busy']:>12.2f} {r['staleness_mean']:>10.2f} {r['continued']:>10.0f} {r['reward']:>7.3f}")
    if len(results) < len(VARIANTS):
        return
    base = results["synchronous"]["steps_per_s"]
    print(f"ratio async / synchronous: {results['async, staleness 1']['steps_per_s'] / base:.2f}x; "
          f"async + partial rollouts / synchronous: {results['async + partial rollouts']['steps_per_s'] / base:.2f}x")


if __name__ == "__main__":
    main()
